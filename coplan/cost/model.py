"""The cost model as one object: a model (spec or graph) whose profiles are built on demand.

A configuration's step is one microbatch's graph priced for the cluster; the graph depends on the
microbatch size and sequence length (and the profile on the fusion groups), so ``CostModel`` keeps
one profile per (microbatch, seq, fusion) it has seen. A search over thousands of configurations
builds a handful of graphs.

Where every block of the model is one template (the decoders and encoders of the presets), a step
under a named kernel set is priced from a graph of ``SHORT_LAYERS`` blocks, its template repeated
to the model's depth (``priced_profile``): the cost model prices blocks by template and the two
ends of the model do not depend on its depth, so the prices are those of the whole graph
(``tests/unit/test_repeated_profile.py``), and an 80-layer model's profile for a new microbatch
size takes milliseconds instead of a quarter of a second.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from coplan.capture.synthetic import build_graph
from coplan.cost.checkpoint import selective_op_names
from coplan.cost.config import ConfigError, TrainingConfig, check_against
from coplan.cost.estimate import Estimate, estimate
from coplan.cost.parts import GraphProfile, Precision
from coplan.cost.profile import profile_graph
from coplan.cost.stacks import StackSpec
from coplan.cost.steptrace import ReservedMemory, reserved_memory
from coplan.hardware.cluster import ClusterSpec
from coplan.ir.types import Graph
from coplan.models.spec import ModelSpec

#: blocks of the graph a repeated profile is read from (``CostModel.priced_profile``): two, so the
#: template is seen to repeat
SHORT_LAYERS = 2


@dataclass(slots=True)
class CostModel:
    """Prices training configurations of one model.

    Give ``spec`` to build graphs for any microbatch and sequence length with the synthetic builder,
    or ``graph`` (e.g. a capture) to price exactly that graph: then only its own microbatch and
    sequence length can be estimated.
    """

    spec: ModelSpec | None = None
    graph: Graph | None = None
    _profiles: dict[tuple[object, ...], GraphProfile] = field(default_factory=dict, repr=False)
    # one graph per (microbatch, seq), shared by its profiles under every fusion and precision
    # (profiling reads a graph, never changes it; building a 70B graph takes ~0.2 s)
    _graphs: dict[tuple[int, int, int], Graph] = field(default_factory=dict, repr=False)
    # repeated profiles (``priced_profile``); None where the short graph's blocks are not one template
    _repeated: dict[tuple[object, ...], GraphProfile | None] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if (self.spec is None) == (self.graph is None):
            raise ValueError("CostModel needs exactly one of spec or graph")

    @property
    def name(self) -> str:
        return self.spec.name if self.spec is not None else (self.graph.meta.model if self.graph else "")

    def seq_of(self, config: TrainingConfig) -> int:
        if self.spec is not None:
            return self.spec.resolve_seq(config.seq)
        assert self.graph is not None
        return config.seq or self.graph.meta.seq

    def selective_op_set(self, config: TrainingConfig) -> frozenset[str]:
        """torchtitan's per-op checkpointing policy as a recompute set of ``config``'s step: the
        policy over the graph its kernels make (``coplan.cost.checkpoint.selective_op_names``), what
        `coplan estimate --recompute selective-op` prices."""
        graph = self.profile(config.microbatch, self.seq_of(config), config.fusion).graph
        return selective_op_names(graph)

    def profile(
        self,
        microbatch: int,
        seq: int,
        fusion: str | tuple[tuple[int, ...], ...] = "megatron",
        precision: Precision | None = None,
        cp: int = 1,
    ) -> GraphProfile:
        """The profile of one microbatch's step at sequence length ``seq``; under context
        parallelism (``cp`` > 1) one rank's step, ``seq`` its share of each sequence."""
        # per-op dtypes change tensor widths and casts; without overrides the dtype is a weight
        precision = precision if precision and precision[1] else None
        key = (microbatch, seq, fusion, precision) if cp == 1 else (microbatch, seq, fusion, precision, cp)
        got = self._profiles.get(key)
        if got is not None:
            return got
        got = profile_graph(self.graph_for(microbatch, seq, cp), fusion, precision)
        self._profiles[key] = got
        return got

    def graph_for(self, microbatch: int, seq: int, cp: int = 1) -> Graph:
        """The whole graph of one microbatch's step (one rank's share of each sequence under
        context parallelism): built once from the spec, or the captured graph where its shape is
        that one."""
        if self.spec is not None:
            graph = self._graphs.get((microbatch, seq, cp))
            if graph is None:
                graph = self._graphs[(microbatch, seq, cp)] = build_graph(self.spec, microbatch, seq, cp=cp)
            return graph
        assert self.graph is not None
        meta = self.graph.meta
        if (meta.batch, meta.seq) != (microbatch, seq):
            raise ConfigError(
                "microbatch",
                f"the graph was captured for microbatch {meta.batch} x seq {meta.seq}; "
                f"cannot price {microbatch} x {seq} without re-capturing",
            )
        return self.graph

    def reserved(self, cluster: ClusterSpec, est: Estimate, stack: StackSpec) -> ReservedMemory | None:
        """What PyTorch's caching allocator reserves at ``est``'s peak under ``stack``
        (``coplan.cost.steptrace``); None on a CPU, whose tensors come from the C library's
        allocator."""
        if cluster.groups[0].device.kind == "cpu":
            return None
        c = est.config
        seq = self.seq_of(c) // c.cp
        return reserved_memory(
            self.graph_for(c.microbatch, seq, c.cp),
            c,
            stack.sharding,
            est.memory.peak_bytes,
            est.memory.capacity_bytes,
            expandable=stack.expandable_segments,
            extra_fraction=stack.reserved_fraction,
            reduce_input=stack.reduce_input,
        )

    def check(self, cluster: ClusterSpec, config: TrainingConfig) -> None:
        """Divisibility and size rules; ``ConfigError`` (exit 2) names the first broken one."""
        if self.spec is not None:
            heads, layers, kv = self.spec.n_heads, self.spec.n_layers, self.spec.kv_heads
        else:
            prof = self.profile(self.graph.meta.batch, self.graph.meta.seq)  # type: ignore[union-attr]
            heads, layers, kv = prof.heads, prof.n_layers, None
        check_against(config, gpus=cluster.num_devices, n_heads=heads, n_layers=layers, n_kv_heads=kv)
        seq = self.seq_of(config)
        if config.cp > 1:
            if self.spec is None:
                raise ConfigError(
                    "cp",
                    "context parallelism needs a model spec (a captured graph is one rank's whole sequence)",
                )
            if seq % (2 * config.cp):
                # each rank takes two of 2 x cp chunks of every sequence, which balances a causal mask
                raise ConfigError("cp", f"sequence {seq} is not divisible by 2 x cp = {2 * config.cp}")
            if not config.flash_attention:
                # the ring passes key/value chunks between fused attention calls (Transformer
                # Engine's and PyTorch's ring attention both run flash kernels per step)
                raise ConfigError(
                    "cp", "context parallelism runs fused (flash) attention; flash_attention is off"
                )
            if any(d.kind == "cpu" for d in cluster.devices):
                raise ConfigError("cp", "context parallelism is priced for GPUs, not CPU devices")

    def priced_profile(
        self,
        microbatch: int,
        seq: int,
        fusion: str | tuple[tuple[int, ...], ...] = "megatron",
        precision: Precision | None = None,
        cp: int = 1,
    ) -> GraphProfile:
        """The profile ``estimate`` prices with: ``profile``'s, or where that is a spec's under a
        named kernel set without per-op dtypes and the blocks of a ``SHORT_LAYERS``-block graph are
        one template, that graph's profile with its template repeated to the model's depth. Op
        groups and per-op dtypes name the whole graph's op ids, so they take the whole graph. It
        relies on a spec building every block alike (``ModelSpec`` has no per-layer field: experts
        are in every block or none); a spec that varied its blocks would need its own check."""
        spec = self.spec
        per_op = not isinstance(fusion, str) or bool(precision and precision[1])
        if spec is None or per_op or spec.n_layers <= SHORT_LAYERS:
            return self.profile(microbatch, seq, fusion, precision, cp)
        key = (microbatch, seq, fusion, cp)
        if key not in self._repeated:
            short = build_graph(replace(spec, n_layers=SHORT_LAYERS), microbatch, seq, cp=cp)
            prof = profile_graph(short, fusion)  # no per-op dtypes here: the dtype is a weight
            got = None
            if len(prof.templates) == 1 and prof.templates[0].blocks == tuple(range(SHORT_LAYERS)):
                block = prof.templates[0]
                n = spec.n_layers
                got = replace(
                    prof,
                    templates=(replace(block, blocks=tuple(range(n))),),
                    n_layers=n,
                    model_flops=float(prof.pre.model_flops + prof.post.model_flops + n * block.model_flops),
                )
            self._repeated[key] = got
        got = self._repeated[key]
        return got if got is not None else self.profile(microbatch, seq, fusion, precision, cp)

    def profile_for(self, config: TrainingConfig) -> GraphProfile:
        """The profile ``estimate`` prices ``config`` with (``coplan.cost.explain`` lists its kernels)."""
        seq, precision = self.seq_of(config) // config.cp, (config.dtype, config.op_dtypes)
        prof = self.priced_profile(config.microbatch, seq, config.fusion, precision, config.cp)
        if config.eager_loss and prof.fusion != "none":
            # the blocks' kernels as configured, the loss side as eager PyTorch runs it: the same
            # graph profiled unfused lends its ``post`` part (same ops, same ids)
            eager = self.priced_profile(config.microbatch, seq, "none", precision, config.cp)
            if len(eager.graph.ops) == len(prof.graph.ops):
                prof = replace(prof, post=eager.post)
        return prof

    def estimate(self, cluster: ClusterSpec, config: TrainingConfig) -> Estimate:
        self.check(cluster, config)
        return estimate(self.profile_for(config), cluster, config)
