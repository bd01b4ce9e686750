// coplan inspect --html: renders the embedded record (every string as text, never markup).
const rec = JSON.parse(document.getElementById('record').textContent);
function el(tag, text, cls){const e=document.createElement(tag);
  if(text!==undefined) e.textContent=String(text);
  if(cls) e.className=cls;
  return e;}
function row(tbody, cells, cls){const tr=document.createElement('tr');
  if(cls) tr.className=cls;
  for(const [v,c] of cells){tr.appendChild(el('td', v, c||''));} tbody.appendChild(tr);
  return tr;}
function us(s){return s==null?'-':(s*1e6).toFixed(2)+' us';}
const passes=document.querySelector('#passes tbody');
const maxOps=Math.max(1,...rec.passes.map(p=>p.ops_after));
for(const p of rec.passes){
  const changed = p.ops_before!==p.ops_after || ['capture','partition','scheduler','codegen'].includes(p.stage);
  const tr=row(passes,[[p.graph],[p.stage],[p.name],[p.fingerprint,'fp'],[p.ops_before,'n'],[p.ops_after,'n'],[p.ops_after-p.ops_before,'n']], changed?'changed':'');
  const td=el('td');
  const bar=el('span',undefined,'bar');
  bar.style.width=(200*p.ops_after/maxOps)+'px';
  td.appendChild(bar);
  tr.appendChild(td);
}
const un=document.querySelector('#unfused tbody');
for(const u of rec.unfused){row(un,[[u.graph],[u.ops.join(' -> ')],[u.count,'n'],[(u.via||[]).join(', ')],[u.reason],[us(u.predicted_saving_s),'n']]);}
const fb=document.querySelector('#fallbacks tbody');
for(const f of rec.fallbacks){row(fb,[[f.graph],[f.op],[f.count,'n'],[f.reason]]);}
const gb=document.querySelector('#breaks tbody');
for(const b of rec.graph_breaks){row(gb,[[b.frame],[b.location],[b.reason]]);}
const kt=document.querySelector('#kernels tbody');
for(const k of rec.kernel_table){row(kt,[[k.graph],[k.name],[k.kind],[(k.aten||[]).join(', ')],[k.bytes,'n'],[us(k.predicted_s),'n']]);}
const box=document.getElementById('lineage-q'); const out=document.getElementById('lineage-results');
function search(){
  const q=box.value.trim().toLowerCase(); out.replaceChildren(); if(!q) return;
  let shown=0;
  for(const [op,ks] of Object.entries(rec.lineage.op_to_kernels)){
    if(op.toLowerCase().includes(q)){const li=el('li');
  li.appendChild(el('code',op));
  li.appendChild(el('span',' -> '+ks.join(', ')));
  out.appendChild(li);
  if(++shown>=200) return;}
  }
  for(const [k,ops] of Object.entries(rec.lineage.kernel_to_ops)){
    if(k.toLowerCase().includes(q)){const li=el('li');
  li.appendChild(el('code',k));
  li.appendChild(el('span',' <- '+ops.join(', ')));
  out.appendChild(li);
  if(++shown>=200) return;}
  }
  if(!shown) out.appendChild(el('li','no op or kernel matches','muted'));
}
box.addEventListener('input', search);
