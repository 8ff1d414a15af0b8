"""No collective over an axis of size 1 (ops/collectives.live_axes, mesh.live_spec): a psum,
pmax, all-to-all, all-gather or ppermute over an axis that holds everything already
moves nothing, yet XLA:CPU keeps it (an all-reduce copies its operand: on one device
the default step ran 32 of them, 19 MB). Read off the optimized HLO of the train step."""

import jax.numpy as jnp
import pytest

from planning import hlo_reader
from test_parallel import MESH_IDS, placed_step, tiny_config
from utils import apply_overrides

# (mesh, expert parallelism, optimizer): one device, dp alone (experts over dp: the
# all-to-all), tp alone; Muon's gathers and AdamW's none.
CASES = [((1, 1, 1), False, "muon"), ((1, 1, 1), False, "adamw"), ((8, 1, 1), True, "muon"), ((1, 1, 8), False, "muon")]


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape, expert_parallel, optimizer", CASES,
                         ids=[f"{MESH_IDS(m)}-{'ep-' if ep else ''}{o}" for m, ep, o in CASES])
def test_no_collective_over_an_axis_of_size_1(mesh_shape, expert_parallel, optimizer):
    """Every collective of the step spans more than one device and some mesh axis of
    size > 1; on one device the step has none at all."""
    cfg = apply_overrides(tiny_config(mesh_shape, expert_parallel), {"train": dict(optimizer=optimizer)})
    step, args = placed_step(cfg)
    hlo = step.lower(*args, jnp.asarray(0)).compile().as_text()
    ops = hlo_reader.collective_ops(hlo, mesh_shape)
    idle = [op for op in ops if op.group_size < 2 or op.over in ("-", "?")]
    assert not idle, idle
    if mesh_shape == (1, 1, 1):
        assert not ops, ops
    else:
        assert ops, "the parser found no collective at all on a split mesh"
