"""llm-foundry's own MPT tables at 8 to 64 GPUs, priced with the ``fsdp`` preset beside the measured
step: every size from 125M to 70B, on H100 and on A100 80GB.

    python benchmarks/data/llmfoundry_tables.py [--json OUT]

The rows are mosaicml/llm-foundry ``scripts/train/benchmarking/README.md`` at 5e85bd62d4, tables
"H100 80GB BF16" (lines 98-149), "A100 80GB with 1600 Gbps node-node interconnect (RoCE)" (lines
166-226) and "H100 80GB FP8" (lines 154-160, ``FP8_ROWS``): model, sequence length, GPUs,
microbatch, gradient accumulation, tokens per second per GPU, mixed-precision mode, activation
checkpointing and parameter count, all FULL_SHARD. The tables were made by ``sweep.sh`` at b2a43a147
(2023-10-19, the commit that wrote them; identical at 5e85bd62d4), which passes no ``--attn_impl``,
so every row ran ``submit_benchmarks.py``'s default ``triton``: MPT's Triton FlashAttention on
padded inputs, the device preset's ``triton`` kernel; the A100 table's two 70B rows are older
(present before b2a43a147, in bf16 with the PURE mode: 16-bit gradient reduction). Every other
setting is the 128-GPU MPT-1B run's of ``published_stack_runs.json`` (the same recipe family and
``submit_benchmarks.py``), with the model sized as ``scripts/train/yamls/pretrain/mpt-<size>.yaml``
at b2a43a147 gives it and the sequence and learned position table as the row says; each row's
parameter count is checked against the table's. Multi-node A100 rows use the table's 1600 Gb/s RoCE
between nodes; the H100 network is not described (dgx-h100 assumed). ``run_config`` at b2a43a147
checks out llm-foundry v0.3.0 for every run; the settings taken from the January 2024 run are an
assumption where that release differed. The step time is global batch x sequence / (tokens per
second per GPU x GPUs).

The device presets' ``triton`` rates were fitted to this table's MPT-1B rows at one node
(``llmfoundry_seq_sweep.py``), so those rows are not a check of them; every other size is."""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1]))

#: (cluster preset, README line, model size, sequence, GPUs, microbatch, gradient accumulation,
#: tokens/s per GPU, mixed-precision mode, activation checkpointing, parameter count)
ROWS: tuple[tuple[str, int, str, int, int, int, int, int, str, bool, int], ...] = (
    ("dgx-h100", 98, "70b", 2048, 64, 8, 4, 1039, "DEFAULT", True, 64862437376),
    ("dgx-h100", 99, "70b", 2048, 32, 2, 16, 882, "DEFAULT", True, 64862437376),
    ("dgx-h100", 100, "30b", 8192, 8, 1, 21, 1384, "DEFAULT", True, 30019254272),
    ("dgx-h100", 101, "30b", 4096, 8, 1, 21, 1802, "DEFAULT", True, 29989894144),
    ("dgx-h100", 102, "30b", 2048, 32, 14, 3, 2308, "DEFAULT", True, 29975214080),
    ("dgx-h100", 103, "30b", 2048, 16, 10, 3, 2263, "DEFAULT", True, 29975214080),
    ("dgx-h100", 104, "30b", 2048, 8, 3, 21, 2002, "DEFAULT", True, 29975214080),
    ("dgx-h100", 105, "30b", 1024, 8, 6, 21, 2084, "DEFAULT", True, 29967874048),
    ("dgx-h100", 106, "13b", 32768, 8, 1, 3, 1976, "DEFAULT", True, 13011240960),
    ("dgx-h100", 107, "13b", 16384, 8, 3, 3, 2985, "DEFAULT", True, 12927354880),
    ("dgx-h100", 108, "13b", 4096, 8, 10, 3, 4717, "DEFAULT", True, 12864440320),
    ("dgx-h100", 109, "13b", 2048, 64, 2, 1, 4800, "DEFAULT", False, 12853954560),
    ("dgx-h100", 110, "13b", 2048, 32, 2, 1, 4811, "DEFAULT", False, 12853954560),
    ("dgx-h100", 111, "13b", 2048, 16, 2, 1, 4767, "DEFAULT", False, 12853954560),
    ("dgx-h100", 112, "13b", 2048, 8, 2, 1, 4792, "DEFAULT", False, 12853954560),
    ("dgx-h100", 113, "13b", 1024, 8, 40, 3, 5502, "DEFAULT", True, 12848711680),
    ("dgx-h100", 114, "7b", 65536, 8, 1, 2, 1956, "DEFAULT", True, 6918905856),
    ("dgx-h100", 115, "7b", 32768, 8, 2, 2, 3318, "DEFAULT", True, 6784688128),
    ("dgx-h100", 116, "7b", 8192, 8, 8, 2, 6935, "DEFAULT", True, 6684024832),
    ("dgx-h100", 117, "7b", 4096, 8, 16, 2, 8611, "DEFAULT", True, 6667247616),
    ("dgx-h100", 118, "7b", 2048, 8, 6, 1, 10643, "DEFAULT", False, 6658859008),
    ("dgx-h100", 119, "7b", 1024, 8, 64, 2, 10203, "DEFAULT", True, 6654664704),
    ("dgx-h100", 120, "3b", 65536, 8, 1, 2, 3262, "DEFAULT", True, 2814366720),
    ("dgx-h100", 121, "3b", 32768, 8, 3, 6, 5873, "DEFAULT", True, 2730480640),
    ("dgx-h100", 122, "3b", 16384, 8, 1, 6, 11152, "DEFAULT", False, 2688537600),
    ("dgx-h100", 123, "3b", 8192, 8, 3, 6, 16578, "DEFAULT", False, 2667566080),
    ("dgx-h100", 124, "3b", 4096, 8, 5, 6, 20964, "DEFAULT", False, 2657080320),
    ("dgx-h100", 125, "3b", 2048, 64, 6, 3, 22525, "DEFAULT", False, 2651837440),
    ("dgx-h100", 126, "3b", 2048, 32, 6, 3, 23021, "DEFAULT", False, 2651837440),
    ("dgx-h100", 127, "3b", 2048, 16, 10, 3, 24142, "DEFAULT", False, 2651837440),
    ("dgx-h100", 128, "3b", 1024, 8, 20, 6, 27046, "DEFAULT", False, 2649216000),
    ("dgx-h100", 129, "3b", 512, 8, 40, 6, 27965, "DEFAULT", False, 2647905280),
    ("dgx-h100", 130, "1b", 65536, 8, 1, 2, 5506, "DEFAULT", True, 1445974016),
    ("dgx-h100", 131, "1b", 32768, 8, 1, 4, 12025, "DEFAULT", False, 1378865152),
    ("dgx-h100", 132, "1b", 16384, 8, 2, 4, 19649, "DEFAULT", False, 1345310720),
    ("dgx-h100", 133, "1b", 8192, 8, 3, 4, 29157, "DEFAULT", False, 1328533504),
    ("dgx-h100", 134, "1b", 4096, 8, 7, 4, 38535, "DEFAULT", False, 1320144896),
    ("dgx-h100", 135, "1b", 2048, 64, 20, 1, 44402, "DEFAULT", False, 1315950592),
    ("dgx-h100", 136, "1b", 2048, 32, 20, 1, 45130, "DEFAULT", False, 1315950592),
    ("dgx-h100", 137, "1b", 2048, 16, 20, 1, 46037, "DEFAULT", False, 1315950592),
    ("dgx-h100", 138, "1b", 2048, 8, 14, 1, 45455, "DEFAULT", False, 1315950592),
    ("dgx-h100", 139, "1b", 1024, 8, 18, 4, 48910, "DEFAULT", False, 1313853440),
    ("dgx-h100", 140, "1b", 512, 8, 56, 4, 52275, "DEFAULT", False, 1312804864),
    ("dgx-h100", 141, "760m", 32768, 8, 1, 2, 16291, "DEFAULT", False, 807656448),
    ("dgx-h100", 142, "760m", 16384, 8, 3, 2, 27815, "DEFAULT", False, 782490624),
    ("dgx-h100", 143, "760m", 8192, 8, 6, 2, 41825, "DEFAULT", False, 769907712),
    ("dgx-h100", 144, "760m", 4096, 8, 12, 2, 55459, "DEFAULT", False, 763616256),
    ("dgx-h100", 145, "760m", 2048, 32, 24, 1, 67971, "DEFAULT", False, 760470528),
    ("dgx-h100", 146, "760m", 2048, 16, 24, 1, 68551, "DEFAULT", False, 760470528),
    ("dgx-h100", 147, "760m", 2048, 8, 24, 2, 63147, "DEFAULT", False, 760470528),
    ("dgx-h100", 148, "760m", 1024, 8, 48, 2, 78581, "DEFAULT", False, 758897664),
    ("dgx-h100", 149, "760m", 512, 8, 96, 2, 83749, "DEFAULT", False, 758111232),
    ("dgx-a100-80gb", 166, "70b", 2048, 64, 8, 4, 410, "PURE", True, 64862437376),
    ("dgx-a100-80gb", 167, "70b", 2048, 32, 2, 16, 373, "PURE", True, 64862437376),
    ("dgx-a100-80gb", 168, "30b", 8192, 8, 1, 21, 574, "DEFAULT", True, 30019254272),
    ("dgx-a100-80gb", 169, "30b", 4096, 8, 1, 21, 814, "DEFAULT", True, 29989894144),
    ("dgx-a100-80gb", 170, "30b", 2048, 8, 3, 21, 916, "DEFAULT", True, 29975214080),
    ("dgx-a100-80gb", 171, "30b", 1024, 8, 6, 21, 946, "DEFAULT", True, 29967874048),
    ("dgx-a100-80gb", 172, "30b", 512, 8, 12, 21, 967, "DEFAULT", True, 29964204032),
    ("dgx-a100-80gb", 173, "13b", 32768, 8, 1, 3, 1016, "DEFAULT", True, 13011240960),
    ("dgx-a100-80gb", 174, "13b", 16384, 8, 3, 3, 1431, "DEFAULT", True, 12927354880),
    ("dgx-a100-80gb", 175, "13b", 8192, 8, 5, 3, 1795, "DEFAULT", True, 12885411840),
    ("dgx-a100-80gb", 176, "13b", 4096, 8, 10, 3, 2060, "DEFAULT", True, 12864440320),
    ("dgx-a100-80gb", 177, "13b", 2048, 8, 2, 3, 2262, "DEFAULT", False, 12853954560),
    ("dgx-a100-80gb", 178, "13b", 1024, 8, 40, 3, 2330, "DEFAULT", True, 12848711680),
    ("dgx-a100-80gb", 179, "7b", 65536, 8, 1, 2, 1013, "DEFAULT", True, 6918905856),
    ("dgx-a100-80gb", 180, "7b", 32768, 8, 2, 2, 1672, "DEFAULT", True, 6784688128),
    ("dgx-a100-80gb", 181, "7b", 16384, 8, 4, 2, 2453, "DEFAULT", True, 6717579264),
    ("dgx-a100-80gb", 182, "7b", 8192, 8, 8, 2, 3206, "DEFAULT", True, 6684024832),
    ("dgx-a100-80gb", 183, "7b", 4096, 8, 16, 2, 3684, "DEFAULT", True, 6667247616),
    ("dgx-a100-80gb", 184, "7b", 2048, 8, 6, 2, 4641, "DEFAULT", False, 6658859008),
    ("dgx-a100-80gb", 185, "7b", 1024, 8, 64, 2, 4357, "DEFAULT", True, 6654664704),
    ("dgx-a100-80gb", 186, "3b", 65536, 8, 1, 2, 1767, "DEFAULT", True, 2814366720),
    ("dgx-a100-80gb", 187, "3b", 32768, 8, 3, 6, 3029, "DEFAULT", True, 2730480640),
    ("dgx-a100-80gb", 188, "3b", 16384, 8, 1, 6, 5529, "DEFAULT", False, 2688537600),
    ("dgx-a100-80gb", 189, "3b", 8192, 8, 3, 6, 7695, "DEFAULT", False, 2667566080),
    ("dgx-a100-80gb", 190, "3b", 4096, 8, 5, 6, 9457, "DEFAULT", False, 2657080320),
    ("dgx-a100-80gb", 191, "3b", 2048, 8, 10, 2, 10811, "DEFAULT", False, 2651837440),
    ("dgx-a100-80gb", 192, "3b", 1024, 8, 20, 6, 11580, "DEFAULT", False, 2649216000),
    ("dgx-a100-80gb", 193, "3b", 512, 8, 40, 6, 12127, "DEFAULT", False, 2647905280),
    ("dgx-a100-80gb", 194, "1b", 65536, 8, 1, 2, 3044, "DEFAULT", True, 1445974016),
    ("dgx-a100-80gb", 195, "1b", 32768, 8, 1, 4, 6275, "DEFAULT", False, 1378865152),
    ("dgx-a100-80gb", 196, "1b", 16384, 8, 2, 4, 9956, "DEFAULT", False, 1345310720),
    ("dgx-a100-80gb", 197, "1b", 8192, 8, 3, 4, 13814, "DEFAULT", False, 1328533504),
    ("dgx-a100-80gb", 198, "1b", 4096, 8, 7, 4, 17807, "DEFAULT", False, 1320144896),
    ("dgx-a100-80gb", 199, "1b", 2048, 8, 14, 4, 20513, "DEFAULT", False, 1315950592),
    ("dgx-a100-80gb", 200, "1b", 1024, 8, 18, 4, 22112, "DEFAULT", False, 1313853440),
    ("dgx-a100-80gb", 201, "1b", 512, 8, 56, 4, 23148, "DEFAULT", False, 1312804864),
    ("dgx-a100-80gb", 202, "760m", 65536, 8, 1, 2, 4143, "DEFAULT", True, 857988096),
    ("dgx-a100-80gb", 203, "760m", 32768, 8, 1, 2, 8802, "DEFAULT", False, 807656448),
    ("dgx-a100-80gb", 204, "760m", 16384, 8, 3, 2, 14274, "DEFAULT", False, 782490624),
    ("dgx-a100-80gb", 205, "760m", 8192, 8, 6, 2, 20933, "DEFAULT", False, 769907712),
    ("dgx-a100-80gb", 206, "760m", 4096, 8, 12, 2, 27351, "DEFAULT", False, 763616256),
    ("dgx-a100-80gb", 207, "760m", 2048, 8, 24, 2, 32434, "DEFAULT", False, 760470528),
    ("dgx-a100-80gb", 208, "760m", 1024, 8, 48, 2, 29765, "DEFAULT", False, 758897664),
    ("dgx-a100-80gb", 209, "760m", 512, 8, 96, 2, 29446, "DEFAULT", False, 758111232),
    ("dgx-a100-80gb", 210, "350m", 65536, 8, 1, 2, 7524, "DEFAULT", False, 420997120),
    ("dgx-a100-80gb", 211, "350m", 32768, 8, 2, 2, 13652, "DEFAULT", False, 387442688),
    ("dgx-a100-80gb", 212, "350m", 16384, 8, 4, 2, 23559, "DEFAULT", False, 370665472),
    ("dgx-a100-80gb", 213, "350m", 8192, 8, 8, 2, 36569, "DEFAULT", False, 362276864),
    ("dgx-a100-80gb", 214, "350m", 4096, 8, 16, 2, 49555, "DEFAULT", False, 358082560),
    ("dgx-a100-80gb", 215, "350m", 2048, 8, 32, 2, 58782, "DEFAULT", False, 355985408),
    ("dgx-a100-80gb", 216, "350m", 1024, 8, 64, 2, 64813, "DEFAULT", False, 354936832),
    ("dgx-a100-80gb", 217, "350m", 512, 8, 128, 2, 69330, "DEFAULT", False, 354412544),
    ("dgx-a100-80gb", 218, "125m", 65536, 8, 1, 2, 20368, "DEFAULT", False, 174070272),
    ("dgx-a100-80gb", 219, "125m", 32768, 8, 2, 2, 36407, "DEFAULT", False, 148904448),
    ("dgx-a100-80gb", 220, "125m", 16384, 8, 4, 2, 60040, "DEFAULT", False, 136321536),
    ("dgx-a100-80gb", 221, "125m", 8192, 8, 8, 2, 90392, "DEFAULT", False, 130030080),
    ("dgx-a100-80gb", 222, "125m", 4096, 8, 16, 2, 118396, "DEFAULT", False, 126884352),
    ("dgx-a100-80gb", 223, "125m", 2048, 8, 40, 2, 142830, "DEFAULT", False, 125311488),
    ("dgx-a100-80gb", 224, "125m", 2048, 8, 32, 2, 141737, "DEFAULT", False, 125311488),
    ("dgx-a100-80gb", 225, "125m", 1024, 8, 64, 2, 156468, "DEFAULT", False, 124525056),
    ("dgx-a100-80gb", 226, "125m", 512, 8, 128, 2, 165681, "DEFAULT", False, 124131840),
)
#: The README's "H100 80GB FP8" table (lines 154-160), the same columns: ``submit_benchmarks.py`` at
#: b2a43a147 runs them with ``amp_fp8`` and ``model.fc_type = 'te'`` (line 470: Transformer Engine
#: v0.10's ``te.Linear`` for every linear layer, installed by ``run_config``, line 412-416), the
#: attention still ``triton``; priced as the device's fp8 GEMMs with Transformer Engine's casts
#: (``coplan.cost.fp8``)
FP8_ROWS: tuple[tuple[str, int, str, int, int, int, int, int, str, bool, int], ...] = (
    ("dgx-h100", 154, "3b", 32768, 8, 3, 6, 5856, "DEFAULT", True, 2730480640),
    ("dgx-h100", 155, "3b", 8192, 8, 3, 6, 19146, "DEFAULT", False, 2667566080),
    ("dgx-h100", 156, "3b", 2048, 8, 10, 6, 30586, "DEFAULT", False, 2651837440),
    ("dgx-h100", 157, "3b", 512, 8, 40, 6, 36527, "DEFAULT", False, 2647905280),
    ("dgx-h100", 158, "1b", 32768, 8, 1, 4, 12580, "DEFAULT", False, 1378865152),
    ("dgx-h100", 159, "1b", 8192, 8, 2, 4, 32010, "DEFAULT", False, 1328533504),
    ("dgx-h100", 160, "1b", 512, 8, 56, 4, 70315, "DEFAULT", False, 1312804864),
)
#: The README's "A100 40GB with 1600 Gbps node-node interconnect (RoCE)" table (lines 232-309), the
#: same columns, older than the others: written by ef350d9e6 (2023-07-05), whose ``sweep.sh`` runs
#: llm-foundry v0.0.4 on the mosaicml/pytorch 1.13.1 image, bf16 with Composer's PURE mode (16-bit
#: gradient reduction), the attention ``triton``; priced with the same settings as the rest, which
#: that release and PyTorch may not have shared
A100_40GB_ROWS: tuple[tuple[str, int, str, int, int, int, int, int, str, bool, int], ...] = (
    ("dgx-a100-40gb", 232, "70b", 2048, 128, 4, 1, 376, "PURE", True, 64862437376),
    ("dgx-a100-40gb", 233, "70b", 2048, 64, 2, 1, 276, "PURE", True, 64862437376),
    ("dgx-a100-40gb", 234, "30b", 2048, 128, 6, 1, 865, "PURE", True, 29975214080),
    ("dgx-a100-40gb", 235, "30b", 2048, 32, 4, 1, 857, "PURE", True, 29975214080),
    ("dgx-a100-40gb", 236, "13b", 8192, 8, 1, 16, 1407, "PURE", True, 12885411840),
    ("dgx-a100-40gb", 237, "13b", 4096, 8, 2, 16, 1603, "PURE", True, 12864440320),
    ("dgx-a100-40gb", 238, "13b", 2048, 128, 16, 1, 1972, "PURE", True, 12853954560),
    ("dgx-a100-40gb", 239, "13b", 2048, 64, 16, 1, 1976, "PURE", True, 12853954560),
    ("dgx-a100-40gb", 240, "13b", 2048, 32, 14, 1, 1998, "PURE", True, 12853954560),
    ("dgx-a100-40gb", 241, "13b", 2048, 16, 10, 1, 1993, "PURE", True, 12853954560),
    ("dgx-a100-40gb", 242, "13b", 2048, 8, 4, 16, 1668, "PURE", True, 12853954560),
    ("dgx-a100-40gb", 243, "13b", 1024, 8, 8, 16, 1727, "PURE", True, 12848711680),
    ("dgx-a100-40gb", 244, "13b", 512, 8, 16, 16, 1763, "PURE", True, 12846090240),
    ("dgx-a100-40gb", 245, "7b", 16384, 8, 1, 4, 2249, "PURE", True, 6717579264),
    ("dgx-a100-40gb", 246, "7b", 8192, 8, 3, 4, 2887, "PURE", True, 6684024832),
    ("dgx-a100-40gb", 247, "7b", 4096, 8, 6, 4, 3366, "PURE", True, 6667247616),
    ("dgx-a100-40gb", 248, "7b", 2048, 128, 18, 1, 3623, "PURE", True, 6658859008),
    ("dgx-a100-40gb", 249, "7b", 2048, 64, 18, 1, 3665, "PURE", True, 6658859008),
    ("dgx-a100-40gb", 250, "7b", 2048, 32, 18, 1, 3725, "PURE", True, 6658859008),
    ("dgx-a100-40gb", 251, "7b", 2048, 16, 16, 1, 3645, "PURE", True, 6658859008),
    ("dgx-a100-40gb", 252, "7b", 2048, 8, 12, 4, 3679, "PURE", True, 6658859008),
    ("dgx-a100-40gb", 253, "7b", 1024, 8, 24, 4, 3854, "PURE", True, 6654664704),
    ("dgx-a100-40gb", 254, "7b", 512, 8, 48, 4, 3895, "PURE", True, 6652567552),
    ("dgx-a100-40gb", 255, "3b", 32768, 8, 1, 4, 2955, "PURE", True, 2730480640),
    ("dgx-a100-40gb", 256, "3b", 16384, 8, 2, 8, 4465, "PURE", True, 2688537600),
    ("dgx-a100-40gb", 257, "3b", 8192, 8, 1, 8, 7149, "PURE", False, 2667566080),
    ("dgx-a100-40gb", 258, "3b", 4096, 8, 2, 8, 8777, "PURE", False, 2657080320),
    ("dgx-a100-40gb", 259, "3b", 2048, 128, 6, 1, 9538, "PURE", False, 2651837440),
    ("dgx-a100-40gb", 260, "3b", 2048, 64, 6, 1, 9736, "PURE", False, 2651837440),
    ("dgx-a100-40gb", 261, "3b", 2048, 32, 6, 1, 9914, "PURE", False, 2651837440),
    ("dgx-a100-40gb", 262, "3b", 2048, 16, 5, 1, 9750, "PURE", False, 2651837440),
    ("dgx-a100-40gb", 263, "3b", 2048, 8, 5, 8, 10065, "PURE", False, 2651837440),
    ("dgx-a100-40gb", 264, "3b", 1024, 8, 10, 8, 10731, "PURE", False, 2649216000),
    ("dgx-a100-40gb", 265, "3b", 512, 8, 20, 8, 11324, "PURE", False, 2647905280),
    ("dgx-a100-40gb", 266, "1b", 32768, 8, 1, 4, 5095, "PURE", True, 1378865152),
    ("dgx-a100-40gb", 267, "1b", 16384, 8, 1, 8, 9715, "PURE", False, 1345310720),
    ("dgx-a100-40gb", 268, "1b", 8192, 8, 2, 8, 13474, "PURE", False, 1328533504),
    ("dgx-a100-40gb", 269, "1b", 4096, 8, 4, 8, 16856, "PURE", False, 1320144896),
    ("dgx-a100-40gb", 270, "1b", 2048, 128, 10, 1, 18647, "PURE", False, 1315950592),
    ("dgx-a100-40gb", 271, "1b", 2048, 64, 10, 1, 19001, "PURE", False, 1315950592),
    ("dgx-a100-40gb", 272, "1b", 2048, 32, 10, 1, 15555, "PURE", False, 1315950592),
    ("dgx-a100-40gb", 273, "1b", 2048, 16, 8, 1, 19085, "PURE", False, 1315950592),
    ("dgx-a100-40gb", 274, "1b", 2048, 8, 8, 8, 19271, "PURE", False, 1315950592),
    ("dgx-a100-40gb", 275, "1b", 1024, 8, 16, 8, 20959, "PURE", False, 1313853440),
    ("dgx-a100-40gb", 276, "1b", 512, 8, 32, 8, 21782, "PURE", False, 1312804864),
    ("dgx-a100-40gb", 277, "760m", 32768, 8, 1, 4, 7183, "PURE", True, 807656448),
    ("dgx-a100-40gb", 278, "760m", 16384, 8, 1, 4, 13914, "PURE", False, 782490624),
    ("dgx-a100-40gb", 279, "760m", 8192, 8, 3, 4, 20106, "PURE", False, 769907712),
    ("dgx-a100-40gb", 280, "760m", 4096, 8, 6, 4, 25863, "PURE", False, 763616256),
    ("dgx-a100-40gb", 281, "760m", 2048, 128, 12, 1, 28940, "PURE", False, 760470528),
    ("dgx-a100-40gb", 282, "760m", 2048, 64, 12, 1, 29344, "PURE", False, 760470528),
    ("dgx-a100-40gb", 283, "760m", 2048, 32, 12, 1, 29648, "PURE", False, 760470528),
    ("dgx-a100-40gb", 284, "760m", 2048, 16, 12, 1, 29607, "PURE", False, 760470528),
    ("dgx-a100-40gb", 285, "760m", 2048, 8, 12, 4, 30173, "PURE", False, 760470528),
    ("dgx-a100-40gb", 286, "760m", 1024, 8, 24, 4, 33422, "PURE", False, 758897664),
    ("dgx-a100-40gb", 287, "760m", 512, 8, 48, 4, 34938, "PURE", False, 758111232),
    ("dgx-a100-40gb", 288, "350m", 32768, 8, 1, 4, 13416, "PURE", False, 387442688),
    ("dgx-a100-40gb", 289, "350m", 16384, 8, 2, 4, 22896, "PURE", False, 370665472),
    ("dgx-a100-40gb", 290, "350m", 8192, 8, 4, 4, 34933, "PURE", False, 362276864),
    ("dgx-a100-40gb", 291, "350m", 4096, 8, 8, 4, 46833, "PURE", False, 358082560),
    ("dgx-a100-40gb", 292, "350m", 2048, 128, 18, 1, 51934, "PURE", False, 355985408),
    ("dgx-a100-40gb", 293, "350m", 2048, 64, 18, 1, 52689, "PURE", False, 355985408),
    ("dgx-a100-40gb", 294, "350m", 2048, 32, 18, 1, 53811, "PURE", False, 355985408),
    ("dgx-a100-40gb", 295, "350m", 2048, 16, 18, 1, 55413, "PURE", False, 355985408),
    ("dgx-a100-40gb", 296, "350m", 2048, 8, 16, 4, 55995, "PURE", False, 355985408),
    ("dgx-a100-40gb", 297, "350m", 1024, 8, 32, 4, 62523, "PURE", False, 354936832),
    ("dgx-a100-40gb", 298, "350m", 512, 8, 64, 4, 66284, "PURE", False, 354412544),
    ("dgx-a100-40gb", 299, "125m", 32768, 8, 1, 4, 32651, "PURE", False, 148904448),
    ("dgx-a100-40gb", 300, "125m", 16384, 8, 2, 3, 55484, "PURE", False, 136321536),
    ("dgx-a100-40gb", 301, "125m", 8192, 8, 5, 3, 86858, "PURE", False, 130030080),
    ("dgx-a100-40gb", 302, "125m", 4096, 8, 13, 3, 115162, "PURE", False, 126884352),
    ("dgx-a100-40gb", 303, "125m", 2048, 128, 26, 1, 123936, "PURE", False, 125311488),
    ("dgx-a100-40gb", 304, "125m", 2048, 64, 26, 1, 125234, "PURE", False, 125311488),
    ("dgx-a100-40gb", 305, "125m", 2048, 32, 26, 1, 127122, "PURE", False, 125311488),
    ("dgx-a100-40gb", 306, "125m", 2048, 16, 26, 1, 130535, "PURE", False, 125311488),
    ("dgx-a100-40gb", 307, "125m", 2048, 8, 26, 3, 136334, "PURE", False, 125311488),
    ("dgx-a100-40gb", 308, "125m", 1024, 8, 52, 3, 148289, "PURE", False, 124525056),
    ("dgx-a100-40gb", 309, "125m", 512, 8, 104, 3, 156735, "PURE", False, 124131840),
)
#: mpt-<size>.yaml at b2a43a147: (layers, d_model, heads); expansion ratio 4, vocabulary 50,368
SIZES = {
    "125m": (12, 768, 12),
    "350m": (24, 1024, 16),
    "760m": (24, 1536, 12),
    "1b": (24, 2048, 16),
    "3b": (32, 2560, 20),
    "7b": (32, 4096, 32),
    "13b": (40, 5120, 40),
    "30b": (48, 7168, 56),
    "70b": (80, 8192, 64),
}
BASE_RUN = "llmfoundry-h100-128gpu-mpt-1b"
#: The A100 table's network between nodes (its heading: "1600 Gbps node-node interconnect (RoCE)")
A100_NODE_GBPS = 1600
#: Rows whose sizes the ``triton`` rates were fitted on (one node, MPT-1B, bf16, on these clusters)
FITTED = "1b"
FITTED_ON = ("dgx-h100", "dgx-a100-80gb")


def base_run() -> dict[str, Any]:
    """The 128-GPU MPT-1B run of ``published_stack_runs.json`` the rows are built from."""
    data = json.loads((HERE / "published_stack_runs.json").read_text())["runs"]
    return next(r for r in data if r["id"] == BASE_RUN)


def table_run(
    base: dict[str, Any],
    cluster: str,
    line: int,
    size: str,
    seq: int,
    gpus: int,
    mb: int,
    accum: int,
    tps: int,
    mode: str = "DEFAULT",
    checkpointing: bool = False,
    attention: str = "triton",
    dtype: str = "bf16",
) -> dict[str, Any]:
    """One table row as a run of ``published_stack_runs.json``'s shape: ``base`` sized as MPT-``size``
    at the row's sequence, layout, precision mode and checkpointing, FULL_SHARD, its attention
    priced as the device's ``attention`` kernel (``triton``: what ran), its linear layers in ``dtype``
    (``fp8``: Transformer Engine's, ``FP8_ROWS``)."""
    r = copy.deepcopy(base)
    r.pop("network", None)
    layers, d_model, heads = SIZES[size]
    r["model"].update(name=f"mpt-{size}", n_layers=layers, d_model=d_model, n_heads=heads, seq_len=seq)
    r.update(
        id=f"llmfoundry-{cluster}-{gpus}gpu-mpt-{size}-seq{seq}-line{line}",
        cluster=cluster,
        gpus=gpus,
        seq=seq,
        microbatch=mb,
        global_batch=mb * accum * gpus,
        zero=3,
        recompute="full" if checkpointing else "none",
        grad_reduce_fp32=mode != "PURE",
        dtype=dtype,
    )
    if cluster.startswith("dgx-a100") and gpus > 8:
        r["network"] = {"node_gbps": A100_NODE_GBPS, "source": "the table's heading"}
    r["stack_settings"].update(
        sharding="FULL_SHARD",
        reshard_after_forward=True,
        attention_unpad=False,
        activation_checkpoint="full" if checkpointing else "none",
    )
    if dtype == "fp8":
        r["stack_settings"]["float8"] = "tensorwise"  # Transformer Engine's per-tensor scaling
    r["attention"] = {
        "kernel": attention,
        "source": "mosaicml/llm-foundry@b2a43a147 scripts/train/benchmarking/sweep.sh: no --attn_impl, "
        "so submit_benchmarks.py's default 'triton' (llmfoundry/models/layers/flash_attn_triton.py, "
        "padded inputs)",
    }
    r["measured"] = {
        "step_time_s": r["global_batch"] * seq / (tps * gpus),
        "published_as": f"README.md line {line} at 5e85bd62d4: {tps} tokens/s per GPU",
    }
    r["size"] = size
    return r


def runs() -> list[dict[str, Any]]:
    """Every row as a run (``table_run``), with the table's parameter count beside it."""
    base = base_run()
    out = []
    for table, dtype in ((ROWS, "bf16"), (FP8_ROWS, "fp8"), (A100_40GB_ROWS, "bf16")):
        for cluster, line, size, seq, gpus, mb, accum, tps, mode, ac, params in table:
            r = table_run(base, cluster, line, size, seq, gpus, mb, accum, tps, mode, ac, dtype=dtype)
            r["table_params"] = params
            out.append(r)
    return out


def table() -> list[dict[str, Any]]:
    import bench_stacks as bs

    from coplan.models.spec import ModelSpec

    rows = []
    for r in runs():
        stack = bs.stack_of(r)
        est = bs.estimated(r, stack)[3]
        measured = r["measured"]["step_time_s"]
        rows.append(
            {
                "id": r["id"],
                "cluster": r["cluster"],
                "size": r["size"],
                "gpus": r["gpus"],
                "seq": r["seq"],
                "checkpointing": r["recompute"] == "full",
                "dtype": r["dtype"],
                "params_match": ModelSpec.from_dict(r["model"]).param_count() == r["table_params"],
                "measured_s": measured,
                "predicted_s": est.step_time_s,
                "error": est.step_time_s / measured - 1,
                # each row ran: its allocated peak must fit the device
                "fits": est.fits,
                "fitted": r["size"] == FITTED
                and r["gpus"] == 8
                and r["dtype"] == "bf16"
                and r["cluster"] in FITTED_ON,
            }
        )
    return rows


def summary(rows: list[dict[str, Any]]) -> list[tuple[str, int, float, float, float]]:
    """(group, runs, mean absolute, mean signed, worst) of the rows the ``triton`` rates were not
    fitted on, by GPU and by whether blocks are checkpointed, and the fp8 rows."""
    out = []
    checked = [r for r in rows if not r["fitted"]]
    groups = [("all checked", checked)]
    bf16 = [r for r in checked if r["dtype"] == "bf16"]
    for cluster in dict.fromkeys(r["cluster"] for r in bf16):
        for ac in (False, True):
            mine = [r for r in bf16 if r["cluster"] == cluster and r["checkpointing"] == ac]
            groups.append((f"{cluster}, {'full AC' if ac else 'no AC'}", mine))
    groups.append(("dgx-h100, fp8 (TE)", [r for r in checked if r["dtype"] == "fp8"]))
    groups.append(("all but the A100 40GB table", [r for r in checked if r["cluster"] != "dgx-a100-40gb"]))
    for name, mine in groups:
        if not mine:
            continue
        errs = [r["error"] for r in mine]
        out.append(
            (name, len(errs), statistics.fmean(map(abs, errs)), statistics.fmean(errs), max(errs, key=abs))
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = table()
    print(f"{'run':58s} {'measured s':>10s} {'priced':>8s} {'error':>7s}")
    for r in rows:
        mark = " (fitted)" if r["fitted"] else ""
        print(
            f"{r['id']:58s} {r['measured_s']:10.3f} {r['predicted_s']:8.3f} {r['error'] * 100:+6.1f}%{mark}"
        )
    print(f"parameter counts equal to the table's: {sum(r['params_match'] for r in rows)} of {len(rows)}")
    unfit = [r["id"] for r in rows if not r["fits"]]
    print(f"configurations that ran, priced as not fitting: {len(unfit)} of {len(rows)} {unfit if unfit else ''}")
    for name, n, mean_abs, signed, worst in summary(rows):
        print(f"{name:28s} {n:3d} runs: mean abs {mean_abs:.1%}, signed {signed:+.1%}, worst {worst:+.1%}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
