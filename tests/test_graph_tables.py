"""StaticBlockTables (steps/graph_tables.py): the fixed block tables a captured paged step would read.

Oracles: the buffers keep their addresses across refreshes (what a replay needs); a table padded
with -1 to the graph's width attends exactly as the cache's own table through the Triton kernel
(interpreted here); the write slots computed on the device equal table[b, p // bs] * bs + p % bs
written out by hand.
"""

from __future__ import annotations

import pytest
import torch

from minigen import ConfigError
from minigen.kernels.triton_attention import decode_attention, plan_decode
from minigen.steps.graph_tables import StaticBlockTables
from test_triton_attention import make_view, reference

pytestmark = pytest.mark.usefixtures("one_thread")


def test_refresh_keeps_the_addresses_and_pads_with_minus_one():
    static = StaticBlockTables(2, 6, 16, "cpu")
    table_ptr, lens_ptr = static.table.data_ptr(), static.lens.data_ptr()
    for n in (3, 5, 2):
        table = torch.arange(2 * n).view(2, n)
        static.refresh(table, torch.tensor([n * 16, n * 16 - 3]))
        assert static.table.data_ptr() == table_ptr and static.lens.data_ptr() == lens_ptr
        assert torch.equal(static.table[:, :n], table) and (static.table[:, n:] == -1).all()
        assert static.lens.tolist() == [n * 16, n * 16 - 3]
    with pytest.raises(ConfigError, match="max_blocks >= 7"):
        static.refresh(torch.zeros(2, 7, dtype=torch.long), torch.zeros(2, dtype=torch.long))


def test_slots_are_the_table_s_blocks_at_the_position():
    static = StaticBlockTables(3, 4, 4, "cpu")
    table = torch.tensor([[7, 2, 5], [3, 0, 4], [1, 6, 8]])
    static.refresh(table, torch.full((3,), 9))
    for p in range(12):
        want = [int(table[b, p // 4]) * 4 + p % 4 for b in range(3)]
        assert static.slots(torch.tensor([p])).tolist() == want


@pytest.mark.parametrize("bits", [None, 4])
def test_a_padded_static_table_attends_as_the_cache_s_own(bits):
    """The graph's wider table (-1 past each row's entries), planned from its capacity: the kernel's
    output equals the cache's view and the dense reference."""
    view = make_view([37, 20], Hkv=2, Dh=32, bs=16, bits=bits, recent=False, seed=3)
    static = StaticBlockTables(2, 8, 16, "cpu")
    static.refresh(view.block_table, view.seq_lens)
    graphed = static.view(view.k, view.v)
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(2))
    out = decode_attention(q, graphed, plan=plan_decode(q, graphed))
    torch.testing.assert_close(out, decode_attention(q, view), atol=2e-5, rtol=0)
    torch.testing.assert_close(out, reference(q, view), atol=2e-5, rtol=0)
