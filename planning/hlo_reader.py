"""Read an optimized HLO module (`compiled.as_text()`: the TPU compiler's, on this CPU,
or XLA:CPU's): its computations and loops, every collective and the mesh axes it spans,
the dot FLOPs of its matmuls and Pallas kernels, which collectives the scheduled
program runs beside matmul work, and the step's time by the compiler's own cost model. Text in, numbers out: nothing here compiles.
planning/tpu_compile.py compiles the steps and prints these figures beside the planner's.
"""

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from utils import CP, MESH_AXES, SLICE

# ---- Collectives
#
# Counted per step: an op inside a loop counts once per trip (XLA's known_trip_count,
# else the constant its loop condition compares the counter with; JAX's scans count
# 0..N-1). collective_table reads the same ops (one parser for both).
# Bytes per device: the op's full buffer (all-gather: its output; reduce-scatter: its
# input, i.e. output x group size; the rest: their output). Async pairs count once (at
# -done, an async collective fusion's chain once: see overlap's comment); "over" names
# the mesh axes its device groups span. Across TPU slices the
# compiler writes no collective op: the part of a reduction that crosses slices is a
# host transfer, `send(...) is_host_transfer=true` with _xla_megascale_transfer_type=
# "ALL_REDUCE" (the megascale runtime's, over the data-center network), and the part
# within a slice an ordinary op; such a send is counted as that kind over "slice", its
# bytes the sent buffer (as the compiler laid it out: tiles of 128 lanes).

COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8}
ARRAY = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([0-9,]*)\]")
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%\S+ = (.*?) ([a-z][a-z0-9-]*)\((.*)$")
COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{\s*$")


def split_computations(hlo):
    """{name: [instruction lines]} and the entry computation's name. An instruction is
    one line: a backend config that spans lines (a Pallas kernel's metadata, whose lines
    may start with "}") is joined onto its instruction's line."""
    comps, entry, name = {}, None, None
    for line in hlo.splitlines():
        head = COMPUTATION.match(line)
        if head and not line.startswith(" "):
            name = head.group(1)
            comps[name] = []
            if line.startswith("ENTRY"):
                entry = name
        elif line.rstrip() == "}":
            name = None
        elif name is not None and comps[name] and not line.startswith("  "):
            comps[name][-1] += " " + line
        elif name is not None:
            comps[name].append(line)
    return comps, entry


def trip_count(loop_line, condition_lines):
    """Trips of a while loop: XLA's known_trip_count where it says it, else the one
    constant its condition compares the counter with (1 when that is not clear)."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', loop_line)
    if known:
        return int(known.group(1))
    constants = [int(c) for line in condition_lines for c in re.findall(r"constant\((\d+)\)", line)]
    return constants[0] if len(constants) == 1 else 1


def executions(comps, entry):
    """{computation: times it runs per call of the entry computation}."""
    callees = defaultdict(list)  # name -> [(callee, multiplier)]
    for name, lines in comps.items():
        for line in lines:
            body = re.search(r"condition=%([^\s,]+), body=%([^\s,]+)", line)
            if body:
                callees[name].append((body.group(2), trip_count(line, comps.get(body.group(1), []))))
                continue
            for callee in re.findall(r"(?:calls|to_apply)=%([^\s,}]+)", line):
                callees[name].append((callee, 1))
            for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                callees[name] += [(c.strip().lstrip("%"), 1) for c in group.split(",")]
    runs = defaultdict(int)

    def visit(name, times):
        runs[name] += times
        for callee, n in callees[name]:
            visit(callee, times * n)

    visit(entry, 1)
    return runs


def device_groups(line, n_devices):
    """Lists of device (partition) ids that an op's groups hold (None: a spelling this
    parser does not know). No groups ({}) means one group of every device."""
    if "source_target_pairs={}" in line:  # a ppermute with nothing to send (pp = 1)
        return []
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    if pairs:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)", pairs.group(0))]
    if re.search(r"replica_groups=\{\}", line):
        return [list(range(n_devices))]
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota:
        shape = [int(n) for n in iota.group(1).split(",")]
        dims = [int(n) for n in iota.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(n) for n in iota.group(3).split(",")])
        return ids.reshape(shape).tolist()
    named = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? \{([^}]*)\}", line)
    if named:  # mesh['dp'=2,'tp'=4] {'tp'}: groups along the named axes
        axes = re.findall(r"'(\w+)'=(\d+)", named.group(1))
        if len(axes) != named.group(1).count("="):
            return None
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        ids = np.arange(math.prod(sizes))
        if named.group(2):
            ids = ids.reshape([int(d) for d in named.group(2).split(",")])
            ids = ids.transpose([int(p) for p in named.group(3).split(",")]) if named.group(3) else ids
        grouped = [names.index(a) for a in re.findall(r"'(\w+)'", named.group(4))]
        kept = [i for i in range(len(names)) if i not in grouped]
        return ids.reshape(sizes).transpose(kept + grouped).reshape(-1, math.prod(sizes[i] for i in grouped)).tolist()
    groups = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
    if groups:
        return [[int(n) for n in g.split(",") if n] for g in re.findall(r"\{([\d,]*)\}", groups.group(1))]
    return None


def axis_names(mesh_shape):
    """The axes of a mesh shape: (slice, dp, cp, pp, tp), or as older callers give it
    (without cp, which then has size 1), (slice, dp, pp, tp) or (dp, pp, tp)."""
    if len(mesh_shape) == len(MESH_AXES):
        return MESH_AXES
    return tuple(a for a in MESH_AXES if a != CP)[-len(mesh_shape):]


def axes_spanned(groups, mesh_shape):
    """The mesh axes along which the devices of a group differ ("dp+tp", "slice+dp", ...;
    "-": none, "?": groups not understood). mesh_shape: see axis_names."""
    if groups is None:
        return "?"
    names = axis_names(mesh_shape)
    varying = set()
    for group in groups:
        coords = np.array(np.unravel_index(group, mesh_shape)).T
        varying |= {names[i] for i in range(len(mesh_shape)) if len(set(coords[:, i])) > 1}
    return "+".join(a for a in names if a in varying) or "-"


def crosses_slices(over):
    """Does a collective over these axes (axes_spanned) cross the data-center network?"""
    return SLICE in over.split("+")


@dataclass(frozen=True)
class CollectiveOp:
    kind: str  # one of COLLECTIVE_KINDS
    over: str  # axes_spanned
    runs: int  # times per step
    group_size: int
    arrays: tuple  # ((dtype, bytes), ...) of its result on one device
    overlapped: bool = False  # an async pair with matmul work scheduled between start and done (overlap())
    computation: str = ""  # the HLO computation it sits in


def collective_ops(hlo, mesh_shape):
    """Every collective of an optimized HLO module, once each: an async pair at its
    -done, an async collective fusion's chain at once (see overlap's comment)."""
    comps, entry = split_computations(hlo)
    runs = executions(comps, entry)
    matmul_of = calls_matmul(comps)
    callers = fusion_callers(comps)
    pairs = {name: overlapped_pairs(lines, matmul_of) for name, lines in comps.items() if runs.get(name)}
    # async-start(..., calls=%wrapped) ... async-done: the collective sits in %wrapped
    wrapped_overlapped = {}
    for name, found in pairs.items():
        for start_line, hidden in found.values():
            wrapped = re.search(r" async-start\(.*calls=%([^\s,}]+)", start_line)
            if wrapped:
                wrapped_overlapped[wrapped.group(1)] = hidden
    ops, chains = [], defaultdict(list)  # (computation scheduling it, chain id) -> [(its line, fused computation)]
    for name, lines in comps.items():
        if not runs.get(name):
            continue
        for line in lines:
            m = INSTRUCTION.match(line)
            if not m:
                continue
            result, op = m.group(1), m.group(2)
            megascale = re.search(r'_xla_megascale_transfer_type="(\w+)"', line) if op == "send" else None
            if megascale:  # across slices (TPU multi-slice): a host transfer over the data-center network
                dtype, dims = ARRAY.search(result).groups()  # (its first element: the data; then a u32 and a token)
                ops.append(CollectiveOp(megascale.group(1).lower().replace("_", "-"), SLICE, runs[name],
                                        mesh_shape[0] if axis_names(mesh_shape)[0] == SLICE else 1,
                                        ((dtype, DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)),)))
                continue
            kind = op[:-len("-done")] if op.endswith("-done") else op
            if kind not in COLLECTIVE_KINDS or op.endswith("-start"):
                continue
            chain = re.search(r'chain_id="(\d+)"', line)
            if chain and name in callers:
                chains[(callers[name][0], chain.group(1))].append((line, name))
                continue
            start_line = line
            if op.endswith("-done"):  # the groups sit on the matching -start
                operand = re.match(r"%([^\s,)]+)", m.group(3))
                start_line = next((s for s in lines if operand and s.lstrip().startswith(f"%{operand.group(1)} =")), line)
            done_name = re.match(r"^\s*(?:ROOT )?%(\S+) =", line).group(1)
            hidden = (pairs[name].get(done_name, ("", False))[1] or wrapped_overlapped.get(name, False)
                      or name in callers and matmul_of[callers[name][2]])  # in a fusion with a convolution
            ops.append(collective_op(kind, start_line, result, runs[name], mesh_shape, hidden, name))
    for (scheduled, _), members in chains.items():
        ops.append(chain_op(members, comps[scheduled], callers, matmul_of, runs[scheduled], mesh_shape, scheduled))
    return ops


def collective_op(kind, line, result, runs, mesh_shape, overlapped, computation):
    """A CollectiveOp of one instruction (`line` holds its device groups, `result` its
    result's type)."""
    groups = device_groups(line, math.prod(mesh_shape))
    arrays = tuple((dtype, DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d))
                   for dtype, dims in ARRAY.findall(result))
    return CollectiveOp(kind, axes_spanned(groups, mesh_shape), runs, len(groups[0]) if groups else 1, arrays,
                        overlapped, computation)


def chain_op(members, scheduled_lines, callers, matmul_of, runs, mesh_shape, scheduled):
    """One CollectiveOp for an async collective fusion's chain: members [(line, fused
    computation)] of one chain_id in one scheduled computation. Its bytes are one
    member's result (each step's op names the whole buffer; the flag range says which
    part it moves). Overlapped when a member shares its fusion with matmul work, or
    matmul work is scheduled between the chain's first fusion and its last."""
    positions = sorted(callers[fused][1] for _, fused in members)
    hidden = (any(matmul_of[callers[fused][2]] for _, fused in members)
              or any(is_matmul_work(line, matmul_of) for line in scheduled_lines[positions[0] + 1:positions[-1]]))
    line = members[0][0]
    m = INSTRUCTION.match(line)
    return collective_op(m.group(2), line, m.group(1), runs, mesh_shape, hidden, scheduled)


def fusion_callers(comps):
    """{fused computation: (the computation whose schedule runs it, the index of the
    fusion instruction there, the computation that instruction calls)}: a fusion
    nested in a fusion is placed by its outermost one."""
    direct = {}  # fused computation -> (caller computation, line index)
    for name, lines in comps.items():
        for i, line in enumerate(lines):
            m = INSTRUCTION.match(line)
            if m and m.group(2) == "fusion":
                for callee in re.findall(r"calls=%([^\s,}]+)", line):
                    direct[callee] = (name, i)
    out = {}
    for fused in direct:
        outer = fused
        while direct[outer][0] in direct:
            outer = direct[outer][0]
        out[fused] = (*direct[outer], outer)
    return out


def operand_names(args):
    """The %names an instruction's argument text starts with (its operands)."""
    return re.findall(r"%([^\s,)]+)", args.split("),")[0])


def matmul_flops(line, result, args, dims_of):
    """FLOPs of one dot, or of a convolution (XLA:TPU writes matmuls as convolutions:
    dim_labels=bf_io->bf), from its result and operand shapes: 2 x result elements x
    contracted size. A convolution contracts its kernel's input features and the window
    taps that land on its input (real_taps)."""
    out = math.prod(int(d) for d in ARRAY.search(result).group(2).split(",") if d)
    lhs, rhs = operand_names(args)[:2]
    if " dot(" in line:
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line).group(1)
        return 2 * out * math.prod(dims_of[lhs][int(d)] for d in contracting.split(",") if d)
    lhs_labels, kernel_labels, out_labels = re.search(r"dim_labels=([^_]+)_([^-]+)->(\w+)", line).groups()
    in_features = dims_of[rhs][kernel_labels.index("i")]
    window = re.search(r"window=\{([^}]*)\}", line)
    if not window:
        return 2 * out * in_features
    out_dims = [int(d) for d in ARRAY.search(result).group(2).split(",") if d]
    taps = 1.0
    for d, (size, stride, (low, _), dilate) in enumerate(window_dims(window.group(1))):
        n, m = dims_of[lhs][lhs_labels.index(str(d))], out_dims[out_labels.index(str(d))]
        taps *= real_taps(n, m, size, stride, low, dilate) / m
    return round(2 * out * in_features * taps)


def window_dims(window):
    """[(size, stride, (pad low, pad high), lhs_dilate)] per spatial dim of an HLO window."""
    fields = dict(field.split("=") for field in window.split())
    sizes = [int(n) for n in fields["size"].split("x")]

    def per_dim(name, parse, default):
        return [parse(v) for v in fields[name].split("x")] if name in fields else [default] * len(sizes)
    return list(zip(sizes, per_dim("stride", int, 1), per_dim("pad", lambda v: tuple(int(p) for p in v.split("_")), (0, 0)),
                    per_dim("lhs_dilate", int, 1)))


def real_taps(n, m, size, stride, low, dilate):
    """Window taps over one spatial dim, all m outputs together, that land on one of the
    n input elements rather than on padding or a dilation's hole: XLA:TPU writes batched
    matmuls and outer products as windows mostly over such (window={size=8 stride=7
    lhs_dilate=8}, or size=4 pad=3_3 over a dim of 1), which multiply nothing."""
    index_M = np.arange(m) * stride - low
    return sum(int(np.sum((index_M + tap >= 0) & (index_M + tap <= (n - 1) * dilate) & ((index_M + tap) % dilate == 0)))
               for tap in range(size))


GROUPED_MATMUL = re.compile(r"^\s*(?:ROOT )?%\S*?(t?gmm)\S* = ")


def kernel_arrays(line):
    """(operands, results) of a Pallas kernel's custom call: [(dtype, [dims])] each, the
    operands from its operand_layout_constraints, the results from before custom-call(."""
    def arrays(text):
        return [(dtype, [int(d) for d in dims.split(",") if d]) for dtype, dims in ARRAY.findall(text)]
    operands = line.split("operand_layout_constraints=", 1)[1].split("frontend_attributes=", 1)[0]
    return arrays(operands), arrays(line.split(" custom-call(", 1)[0])


def grouped_matmul_flops(line):
    """FLOPs of a megablox gmm or tgmm kernel (a tpu_custom_call, model.grouped_matmul; 0
    for any other custom call) as its grid runs them: every row tile it may visit, the
    tiles of the m rows plus one per group boundary inside a tile (its group_ids
    operand holds one entry per such tile), each tm x k x n. Operands: group_offsets
    [E + 1], group_ids, m_tile_ids, group_offset, lhs, rhs."""
    kind = GROUPED_MATMUL.match(line)
    if not kind or 'custom_call_target="tpu_custom_call"' not in line:
        return 0
    operands, results = kernel_arrays(line)
    (groups_plus_one,), (visited_tiles,), _, _, lhs, rhs = [dims for _, dims in operands[-6:]]  # (vmapped: the batch index first)
    if kind.group(1) == "gmm":  # [m, k] rows by [E, k, n] (or [E, n, k], transposed) weights into [m, n]
        (m, k), n = lhs, results[0][1][-1]
    else:  # tgmm: [k, m] by [m, n] into [E, k, n]
        (k, m), (_, n) = lhs, rhs
    row_tiles = visited_tiles - (groups_plus_one - 1) + 1
    return 2 * visited_tiles * (m // row_tiles) * k * n


SPLASH = re.compile(r"^\s*(?:ROOT )?%splash_m[hq]a_(fwd|dq|dkv)\S* = ")
# Multiply-adds per visible (query, key) pair of one head, W the query/key width and K
# the value's: the forward takes scores (W) and values (K); the dq kernel takes the
# scores again, dP = dO V^T (K) and dQ = dS K (W); the dkv kernel the scores again, dV
# (K), dP (K) and dK (W), and dQ (W) too when it is fused into it.
SPLASH_MACS = {"fwd": lambda W, K: W + K, "dq": lambda W, K: 2 * W + K, "dkv": lambda W, K: 2 * W + 2 * K}


def causal_blocks(n_q, n_k, Tq, S):
    """How many of a splash kernel's [n_q, n_k] blocks a causal mask visits (those with
    a key at or before their last query; the queries the last Tq of S positions)."""
    q_last = (np.arange(n_q) + 1) * (Tq // n_q) - 1 + (S - Tq)
    k_first = np.arange(n_k) * (S // n_k)
    return int(np.sum(k_first[None, :] <= q_last[:, None]))


def attention_kernel_flops(line):
    """FLOPs of a splash attention kernel (a tpu_custom_call named splash_m{h,q}a_{fwd,
    dq,dkv}...; 0 for any other): every (query, key) pair of the blocks it visits, the
    mask taken as causal (the kernel's block mask, its first operand [heads, n_q, n_k],
    holds the block grid; its values are not in the text). Its float operands: q [...,
    H, Tq, W], k [..., S, W], v [..., S, K]; a fused dkv kernel also returns dq
    unreduced (a result of q's rank + 1)."""
    kind = SPLASH.match(line)
    if not kind or 'custom_call_target="tpu_custom_call"' not in line or "operand_layout_constraints=" not in line:
        return 0
    operands, results = kernel_arrays(line)
    (_, n_q, n_k), q, k, v = operands[0][1], *[dims for dtype, dims in operands if dtype.startswith(("f", "bf"))][:3]
    *lead, Tq, W = q
    S, K = k[-2], v[-1]
    macs = SPLASH_MACS[kind.group(1)](W, K)
    if kind.group(1) == "dkv" and any(len(dims) == len(q) + 1 and dims[-2:] == [Tq, W] for _, dims in results):
        macs += W
    pairs = int(np.prod(lead)) * Tq * S * causal_blocks(n_q, n_k, Tq, S) / (n_q * n_k)
    return int(2 * macs * pairs)


def attention_kernel_bytes(line):
    """Bytes a splash kernel reads and writes in HBM: its operands, and its results of
    q's rank (its others, of lower rank, are its VMEM scratch)."""
    operands, results = kernel_arrays(line)
    rank = max(len(dims) for _, dims in operands)
    return sum(DTYPE_BYTES[t] * int(np.prod(dims)) for t, dims in operands + [(t, dims) for t, dims in results if len(dims) >= rank])


def kernel_flops(line):
    """FLOPs of a Pallas kernel counted from its shapes (megablox or splash; else 0)."""
    return grouped_matmul_flops(line) + attention_kernel_flops(line)


KERNEL_CALL = re.compile(r'^\s*(?:ROOT )?%([\w-]+?)(?:\.\d+)? = .*custom_call_target="tpu_custom_call"')


def kernels(hlo):
    """The Pallas kernels of an optimized TPU module, {name: how many calls its text holds}
    (the instruction's name less its ".N" suffix: splash_mha_fwd_residuals, gmm, ...; a
    call in a loop counts once)."""
    found = defaultdict(int)
    for lines in split_computations(hlo)[0].values():
        for line in lines:
            if m := KERNEL_CALL.match(line):
                found[m.group(1)] += 1
    return dict(found)


# 8-bit operand types of HLO (--model.quant int8 / fp8's matmuls)
LOW_PRECISION_TYPES = ("s8", "u8", "f8e4m3fn", "f8e5m2", "f8e4m3", "f8e4m3fnuz", "f8e5m2fnuz", "f8e4m3b11fnuz")


def low_precision_dot_flops(hlo):
    """dot_flops of the dots and convolutions whose two operands are int8 or fp8."""
    return dot_flops(hlo, low_precision=True)


def dot_flops(hlo, name_part="", low_precision=False):
    """FLOPs per step on one device of the dots and convolutions of an optimized HLO
    module whose metadata contains name_part (e.g. a jax.named_scope), loops counted by
    their trips. A conditional counts its costliest branch (each device runs one).
    low_precision: only those whose two operands are 8-bit (LOW_PRECISION_TYPES)."""
    comps, entry = split_computations(hlo)
    memo = {}

    def flops(name):
        if name in memo:
            return memo[name]
        memo[name] = 0  # (no recursion in HLO; guards a malformed module)
        lines = comps.get(name, [])
        dims_of, types_of = {}, {}
        for line in lines:
            m = re.match(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([0-9,]*)\]", line)
            if m:
                dims_of[m.group(1)], types_of[m.group(1)] = [int(d) for d in m.group(3).split(",") if d], m.group(2)
        total = 0
        for line in lines:
            m = INSTRUCTION.match(line)
            if not m:
                continue
            op = m.group(2)
            if op in ("dot", "convolution") and name_part in line and (
                    not low_precision or all(types_of.get(a) in LOW_PRECISION_TYPES for a in operand_names(m.group(3))[:2])):
                total += matmul_flops(line, m.group(1), m.group(3), dims_of)
            if op == "custom-call" and name_part in line and not low_precision:  # (no 8-bit gmm: utils refuses it)
                total += kernel_flops(line)
            loop = re.search(r"condition=%([^\s,]+), body=%([^\s,]+)", line)
            if loop:
                total += trip_count(line, comps.get(loop.group(1), [])) * flops(loop.group(2))
                continue
            for callee in re.findall(r"(?:calls|to_apply)=%([^\s,}]+)", line):
                total += flops(callee)
            for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                total += max(flops(c.strip().lstrip("%")) for c in group.split(","))
        memo[name] = total
        return total

    return flops(entry)


# ---- Overlap: which communication the compiled schedule hides behind compute
#
# An optimized TPU module is scheduled (is_scheduled=true): each computation lists its
# instructions in the order they run. The compiler writes communication that runs
# beside compute in three forms, each counted as overlapped when matmul work (a dot or
# convolution, directly or inside a fusion, call or loop) runs beside it:
#
# - a start/done pair (collective-permute-start ... -done, all-gather-start, an
#   async-start wrapping one): moves its data while the instructions scheduled between
#   the two run; overlapped when matmul work is among them;
# - an async collective fusion (devices.TPU_OVERLAP_FLAGS): one collective split into
#   steps, each an op carrying frontend_attributes={chain_id="N"} and an
#   async_collective_fusion_config flag range, inside fusions of the scheduled
#   computation: the first beside an AsyncCollectiveStart custom call, the middle ones
#   in `async_collective_fusion` computations beside this step's convolutions, the last
#   beside an AsyncCollectiveDone. Every step names the whole buffer, so a chain counts
#   once (chain_op); overlapped when a step shares its fusion with matmul work or
#   matmul work is scheduled between its first fusion and its last;
# - any other collective inside a fusion that also runs matmul work.
#
# A plain collective (all-gather, all-reduce) holds up the program while it moves, and
# elementwise or index work beside a collective hides communication of no size, so
# neither counts.

BOOKKEEPING_OPS = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
                   "replica-id", "opt-barrier")


def calls_matmul(comps):
    """{computation: does it (or anything it calls) run a dot or convolution}."""
    memo = {}

    def has(name):
        if name not in memo:
            memo[name] = False
            memo[name] = any(INSTRUCTION.match(line) and INSTRUCTION.match(line).group(2) in ("dot", "convolution")
                             or any(has(c) for c in re.findall(r"(?:calls|to_apply|body|condition)=%([^\s,}]+)", line))
                             for line in comps.get(name, []))
        return memo[name]
    return {name: has(name) for name in comps}


def overlapped_pairs(lines, matmul_of):
    """{name of each -done (collective-permute-done, async-done, ...): (its start's line,
    whether matmul work is scheduled between the two)}."""
    position, out = {}, {}
    for i, line in enumerate(lines):
        m = INSTRUCTION.match(line)
        if not m:
            continue
        name = re.match(r"^\s*(?:ROOT )?%(\S+) =", line).group(1)
        position[name] = i
        if m.group(2).endswith("-done"):
            start = operand_names(m.group(3))
            if start and start[0] in position:
                between = lines[position[start[0]] + 1:i]
                out[name] = (lines[position[start[0]]], any(is_matmul_work(b, matmul_of) for b in between))
    return out


def is_matmul_work(line, matmul_of):
    m = INSTRUCTION.match(line)
    if not m or m.group(2) in BOOKKEEPING_OPS:
        return False
    if m.group(2) in ("dot", "convolution"):
        return True
    return any(matmul_of.get(c) for c in re.findall(r"(?:calls|to_apply|body)=%([^\s,}]+)", line))


def overlap(hlo, mesh_shape):
    """{"overlapped": bytes, "exposed": bytes, "by kind": {(kind, over): {"overlapped": bytes,
    "exposed": bytes}}} per device per step, the bytes as busiest_collective_bytes counts
    them (loops by their trips, a conditional at its costliest branch)."""
    table = per_step_bytes(hlo, mesh_shape, lambda op: (op.kind, op.over, "overlapped" if op.overlapped else "exposed"))
    out = {"overlapped": 0, "exposed": 0, "by kind": defaultdict(lambda: {"overlapped": 0, "exposed": 0})}
    for (kind, over, where), nbytes in table.items():
        out[where] += nbytes
        out["by kind"][(kind, over)][where] += nbytes
    out["by kind"] = dict(out["by kind"])
    return out


def busiest_collective_bytes(hlo, mesh_shape):
    """{"kind over axes": bytes} per device per step, as collectives() counts an op's bytes,
    but a conditional counting only its costliest branch (by bytes), as dot_flops does:
    a device runs one branch, and the HLO does not say which (the 1F1B executor's
    per-tick cond: each tick at its costliest op)."""
    return per_step_bytes(hlo, mesh_shape, lambda op: f"{op.kind} over {op.over}")


def per_step_bytes(hlo, mesh_shape, key):
    """{key(op): bytes} per device per step of the module's collectives: each op's bytes
    as collectives() counts them, times the trips of the loops around it, a conditional
    counting only its costliest branch (by bytes)."""
    comps, entry = split_computations(hlo)
    own = defaultdict(lambda: defaultdict(int))
    for op in collective_ops(hlo, mesh_shape):
        nbytes = sum(b for _, b in op.arrays) * (op.group_size if op.kind == "reduce-scatter" else 1)
        own[op.computation][key(op)] += nbytes
    memo = {}

    def total(name):
        if name in memo:
            return memo[name]
        memo[name] = {}
        out = defaultdict(int, own.get(name, {}))

        def add(table, times):
            for k, nbytes in table.items():
                out[k] += times * nbytes
        for line in comps.get(name, []):
            loop = re.search(r"condition=%([^\s,]+), body=%([^\s,]+)", line)
            if loop:
                add(total(loop.group(2)), trip_count(line, comps.get(loop.group(1), [])))
                continue
            for callee in re.findall(r"(?:calls|to_apply)=%([^\s,}]+)", line):
                add(total(callee), 1)
            for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                add(max((total(c.strip().lstrip("%")) for c in group.split(",")), key=lambda t: sum(t.values())), 1)
        memo[name] = dict(out)
        return memo[name]

    return total(entry)


def collective_table(hlo_text, mesh):
    """{(kind, axes): (count, bytes)} per step per device: each collective in the
    optimized HLO, times the trip count of the loops around it. Bytes are the
    collective's result on one device (for an all-gather the gathered array, for a
    reduce-scatter the scattered shard); axes "none": it moves nothing. (bench.py and
    the tests compare the automatic executor's choices with the shard_map ones.)"""
    table = {}
    for op in collective_ops(hlo_text, mesh.devices.shape):
        key = (op.kind, "none" if op.over == "-" else op.over)
        count, nbytes = table.get(key, (0, 0))
        table[key] = (count + op.runs, nbytes + op.runs * sum(b for _, b in op.arrays))
    return dict(sorted(table.items()))


def collectives(hlo, mesh_shape):
    """{(kind, dtype, over): {"count": per step, "bytes": per device per step}}."""
    table = defaultdict(lambda: {"count": 0, "bytes": 0})
    for op in collective_ops(hlo, mesh_shape):
        for dtype, nbytes in op.arrays:
            row = table[(op.kind, dtype, op.over)]
            row["count"] += op.runs
            row["bytes"] += op.runs * nbytes * (op.group_size if op.kind == "reduce-scatter" else 1)
    return dict(table)


# ---- The compiler's clock
#
# The TPU compiler's cost model (the one its scheduler uses) writes its estimate of an
# op's run time into the op's backend_config, "estimated_cycles", in the chip's clock
# cycles: on every fusion and on many a lone op (copy, broadcast, slice). A Pallas
# kernel (tpu_custom_call) carries none; Mosaic writes a cost_estimate (flops,
# bytes_accessed) instead, timed here at its roofline on the chip. Per step an op
# counts once per run of its computation: a loop's body by its trips and its condition
# once more, a conditional at its costliest branch only (each device runs one branch),
# and never inside a fused computation (the fusion's own estimate covers it).

CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
KERNEL_COST = re.compile(r'"cost_estimate":\{([^{}]*)\}')
OP_NAME = re.compile(r'op_name="([^"]*)"')
COMPUTE_KINDS = ("matmul fusions", "other fusions", "copies and transposes", "kernels", "other ops")
LAYOUT_OPS = ("copy", "transpose", "copy-start", "copy-done")


@dataclass(frozen=True)
class Chip:
    clock_hz: float  # the TensorCore's clock: estimated_cycles' unit
    peak_flops: float  # dense bf16 FLOP/s (a kernel's roofline)
    hbm_bytes_per_s: float  # HBM bandwidth (a kernel's roofline)


@dataclass(frozen=True)
class TimedOp:
    name: str  # the instruction's name
    kind: str  # one of COMPUTE_KINDS
    seconds: float  # one run, on the compiler's clock
    runs: int  # per step
    op_name: str  # its metadata's op_name: the jax.named_scope path of what it computes

    @property
    def step_seconds(self):
        return self.seconds * self.runs


def kernel_seconds(line, chip):
    """A Pallas kernel's time at its roofline, max(flops / peak, bytes / HBM bandwidth),
    from Mosaic's cost_estimate; a splash kernel, which carries none, from its FLOPs
    counted here (attention_kernel_flops) and the bytes of its operands and results.
    None for another kernel with no estimate."""
    cost = KERNEL_COST.search(line)
    if cost:
        fields = {k: float(v) for k, v in json.loads("{" + cost.group(1) + "}").items()}
    elif flops := attention_kernel_flops(line):
        fields = {"flops": flops, "bytes_accessed": attention_kernel_bytes(line)}
    else:
        return None
    return max(fields.get("flops", 0) / chip.peak_flops, fields.get("bytes_accessed", 0) / chip.hbm_bytes_per_s)


def compute_kind(op, line, comps, matmul_of):
    """Which of COMPUTE_KINDS an op is: a fusion by what it fuses (a dot or convolution:
    matmul; nothing but copies, transposes and bookkeeping: a layout change)."""
    if op == "custom-call":
        return "kernels"
    if op in ("dot", "convolution"):
        return "matmul fusions"
    if op in LAYOUT_OPS:
        return "copies and transposes"
    if op != "fusion":
        return "other ops"
    fused = re.search(r"calls=%([^\s,}]+)", line).group(1)
    if matmul_of.get(fused):
        return "matmul fusions"
    inner = {INSTRUCTION.match(f).group(2) for f in comps.get(fused, []) if INSTRUCTION.match(f)}
    return "copies and transposes" if inner <= set(LAYOUT_OPS + BOOKKEEPING_OPS + ("reshape",)) else "other fusions"


def own_timed_ops(lines, comps, matmul_of, chip):
    """[(name, kind, seconds, op_name)] of one computation's ops that carry an estimate."""
    out = []
    for line in lines:
        m = INSTRUCTION.match(line)
        if not m:
            continue
        cycles = CYCLES.search(line)
        seconds = int(cycles.group(1)) / chip.clock_hz if cycles else None
        if seconds is None and 'custom_call_target="tpu_custom_call"' in line:
            seconds = kernel_seconds(line, chip)
        if seconds is not None:
            name = re.match(r"^\s*(?:ROOT )?%(\S+) =", line).group(1)
            op_name = OP_NAME.search(line)
            out.append((name, compute_kind(m.group(2), line, comps, matmul_of), seconds, op_name.group(1) if op_name else ""))
    return out


def scheduled_callees(line, comps):
    """[(computation, runs per run of this instruction)] that an instruction runs, a
    conditional's branches as one list [(branch, 1), ...] (it runs one); a fusion's
    computation is not among them."""
    loop = re.search(r"condition=%([^\s,]+), body=%([^\s,]+)", line)
    if loop:
        trips = trip_count(line, comps.get(loop.group(1), []))
        return [(loop.group(2), trips), (loop.group(1), trips + 1)]
    branches = re.search(r"branch_computations=\{([^}]*)\}", line)
    if branches:
        return [[(c.strip().lstrip("%"), 1) for c in branches.group(1).split(",")]]
    m = INSTRUCTION.match(line)
    if m and m.group(2) == "fusion":
        return []
    return [(c, 1) for c in re.findall(r"(?:calls|to_apply)=%([^\s,}]+)", line)]


def timed_ops(hlo, chip):
    """[TimedOp] of an optimized TPU module: every op that carries the compiler's
    estimate (or a Pallas kernel's cost_estimate), with its runs per step; those of a
    conditional's branches other than its costliest are left out."""
    comps, entry = split_computations(hlo)
    matmul_of = calls_matmul(comps)
    own = {name: own_timed_ops(lines, comps, matmul_of, chip) for name, lines in comps.items()}
    callees = {name: [c for line in lines for c in scheduled_callees(line, comps)] for name, lines in comps.items()}
    memo = {}

    def total(name):  # seconds of one run of a computation, all it runs included
        if name not in memo:
            memo[name] = 0.0
            memo[name] = sum(s for _, _, s, _ in own.get(name, [])) + sum(
                max(total(b) for b, _ in c) if isinstance(c, list) else total(c[0]) * c[1] for c in callees.get(name, []))
        return memo[name]

    runs = defaultdict(int)

    def visit(name, times):
        runs[name] += times
        for c in callees.get(name, []):
            callee, n = max(c, key=lambda b: total(b[0])) if isinstance(c, list) else c
            visit(callee, times * n)

    visit(entry, 1)
    return [TimedOp(name, kind, seconds, runs[comp], op_name)
            for comp, ops in own.items() for name, kind, seconds, op_name in ops if runs.get(comp)]


def seconds_by(ops, key):
    """{key(op): seconds per step} of TimedOps, costliest first."""
    out = defaultdict(float)
    for op in ops:
        out[key(op)] += op.step_seconds
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def model_part(op_name, parts):
    """The innermost of `parts` (jax.named_scope names) on an op_name's path, "other"
    when none is: jit(train_step)/transpose(jvp())/while/body/attention/dot_general ->
    attention."""
    steps = re.split(r"[/()]", op_name)
    return next((s for s in reversed(steps) if s in parts), "other")
