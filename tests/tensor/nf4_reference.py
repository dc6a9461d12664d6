#!/usr/bin/env python3
"""NF4 with double quantisation from its definition, against meshtrain's nf4 (tensor/nf4.h).

The definition is bitsandbytes' quantize_4bit(quant_type="nf4", blocksize=64,
compress_statistics=True) as its pure-torch ("default") kernels state it, every product and
comparison in f32, with the mean of the absmax values summed in float64 and rounded once. This
file rebuilds everything from that definition with torch and numpy, independently of the C++:

  * the 16 NF4 levels: bitsandbytes' create_normal_map(offset=0.9677083, use_extra_value=True),
    the inverse normal CDF (torch.distributions.Normal(0, 1).icdf) in float64 at the f32
    torch.linspace quantiles, normalised by the largest; checked against the C++ table (1e-7);
  * the signed 8-bit dynamic map: create_dynamic_map(signed=True) with torch.linspace in f32,
    which the C++ table must equal bit for bit. torch.linspace's f32 values depend on the
    torch build (Debian's 1.13 takes an AVX2 path; 2.x rounds start + step * i once, as a
    fused multiply-add), so the map is also built from the kernel's formula written out both
    ways, and the message says which one the C++ table and this torch follow; the cases are
    then checked with the written-out map the C++ table equals;
  * quantise: absmax per 64, clamp(x * (1 / absmax), -1, 1), torch.bucketize (right=False) on
    the f32 midpoints, the first element of a pair in the high nibble; offset = f32(mean of
    the absmax in float64); per 256 blocks s = max |absmax - offset| and the codes of
    (absmax - offset) * (1 / s) on the dynamic map;
  * dequantise: NF4[q] * (DYN[c] * s + offset) in f32 (each product and sum rounded), then
    round-to-nearest-even to bf16 / f16; and the same formula in float64, which the f32 result
    must be within a few f32 roundings of.

Input: a directory (written by tests/tensor/nf4_test.cpp) with index.json and raw
little-endian files: each case's f32 input, the packed buffer nf4::quantize made
([s f32 x groups][offset f32][c u8 x blocks][q u8 x n/2], zero-padded to 4 bytes), the f32
output of nf4::dequantize and the outputs of the CPU backend's dequantize_nf4 (f32, bf16, f16).
Everything is compared byte for byte; one line per case; exit 1 on any mismatch.

--bitsandbytes also compares with bitsandbytes itself (bitsandbytes.functional.quantize_4bit /
dequantize_4bit on CPU): packed bytes, state.absmax (the codes), state.state2.absmax (s),
state.offset, and the f32 and bf16 dequantisation, plus bitsandbytes' dequantisation of
meshtrain's own state (with meshtrain's map). Exit 77 (a ctest skip) when bitsandbytes is
not importable. A mismatch is explained: each case says whether bitsandbytes' state equals the
definition with its known departures (torch's f32 mean instead of the float64 one; its native
CPU quantize_blockwise's 65536-entry lookup table instead of bucketize, with code 0 where
s = 0; its torch's dynamic map).

usage: nf4_reference.py DIR [--bitsandbytes]
Runs under Debian's python3 (torch 1.13) and the hf-venv python (torch 2.x).
"""

import argparse
import json
import math
import os
import sys

import numpy as np
import torch

BLOCK = 64
SCALE_BLOCK = 256


# ---- the tables


def normal_quantiles_f64():
    """v1 + [0] + v3 of create_normal_map(offset=0.9677083, use_extra_value=True), float64.

    bitsandbytes: v1 = norm.ppf(linspace(offset, 0.5, 9)[:-1]), 241 zeros,
    v3 = -norm.ppf(linspace(offset, 0.5, 8)[:-1]); the quantiles are torch.linspace's default
    dtype (f32), the inverse CDF float64 (here torch.distributions.Normal(0, 1).icdf).
    """
    offset = 0.9677083
    normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64),
                                        torch.tensor(1.0, dtype=torch.float64))
    p9 = torch.linspace(offset, 0.5, 9)[:-1].to(torch.float64)
    p8 = torch.linspace(offset, 0.5, 8)[:-1].to(torch.float64)
    return torch.cat([normal.icdf(p9), torch.zeros(1, dtype=torch.float64), -normal.icdf(p8)])


def normal_map_f64():
    """The 16 NF4 levels ascending, normalised by the largest in float64."""
    values = normal_quantiles_f64().sort().values
    return (values / values.max()).tolist()


def normal_map_f32_as_bitsandbytes():
    """create_normal_map's own arithmetic: torch.Tensor(v) (f32), sorted, `values /= max` in f32."""
    values = normal_quantiles_f64().to(torch.float32).sort().values
    values /= values.max()
    return values


def dynamic_map_f32(linspace=None):
    """create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8), as bitsandbytes:
    per exponent i = 0..6 the means of linspace(0.1, 1, 2^i + 1) (f32) times +-10^(i - 6),
    then 0 and 1, sorted. `linspace` defaults to torch.linspace(..., dtype=torch.float32)."""
    if linspace is None:
        def linspace(steps):
            return torch.linspace(0.1, 1, steps, dtype=torch.float32)
    data = []
    for i in range(7):
        boundaries = linspace(2 ** i + 1)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        data += (-(10 ** (-6 + i)) * means).tolist()
    data.append(0)
    data.append(1.0)
    assert len(data) == 256
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


def linspace_formula(steps, fused):
    """torch's CPU linspace kernel written out (start 0.1, end 1, f32; each half stepped from
    its own end): step = (end - start) / (steps - 1); x_i = start + step * i for i < steps / 2,
    else end - step * (steps - 1 - i), each product and sum rounded to f32 (fused=False) or
    rounded once as a fused multiply-add (fused=True; exact in float64, then one rounding)."""
    start, end = np.float32(0.1), np.float32(1.0)
    step = np.float32((end - start) / np.float32(steps - 1))
    out = []
    for i in range(steps):
        k, base, sign = (i, start, 1.0) if i < steps // 2 else (steps - 1 - i, end, -1.0)
        if fused:
            out.append(np.float32(float(base) + sign * float(step) * k))
        else:
            out.append(np.float32(base + np.float32(sign) * np.float32(step * np.float32(k))))
    return torch.from_numpy(np.array(out, dtype=np.float32))


def definition_tables():
    """(NF4 levels, dynamic map), f32: the tables of the definition, which the C++ tables must
    equal bit for bit (create_normal_map's f32 arithmetic; create_dynamic_map with torch 2's
    fused linspace). Importable: tests/reference/generate_fixtures.py quantises with them."""
    levels = normal_map_f32_as_bitsandbytes()
    levels = torch.cat([levels[:7], torch.zeros(1), levels[-8:]])  # the 241 padding zeros out
    return levels, dynamic_map_f32(lambda steps: linspace_formula(steps, fused=True))


def midpoints(code):
    return (code[:-1] + code[1:]) / 2  # f32, as bitsandbytes' bounds


# ---- the definition, in f32


def layout(n):
    assert n > 0 and n % BLOCK == 0
    blocks = n // BLOCK
    groups = (blocks + SCALE_BLOCK - 1) // SCALE_BLOCK
    offset_at = 4 * groups
    codes_at = offset_at + 4
    packed_at = codes_at + blocks
    total = (packed_at + n // 2 + 3) // 4 * 4
    return dict(n=n, blocks=blocks, groups=groups, scales_at=0, offset_at=offset_at,
                codes_at=codes_at, packed_at=packed_at, bytes=total)


def scaled(v, absmax):
    """clamp(v * (1 / max(absmax, 1e-38)), -1, 1) in f32; absmax broadcasts per row."""
    return torch.clamp(v * (1.0 / absmax.clamp(min=1e-38)), -1, 1)


def mean_f64(absmax):
    """f32(mean in float64): math.fsum is the exact sum, rounded once to float64."""
    return np.float32(math.fsum(float(a) for a in absmax.tolist()) / absmax.numel())


def quantize(x, levels, dyn):
    """x: f32 tensor of n elements -> dict of the pieces and the packed byte buffer."""
    n = x.numel()
    lay = layout(n)
    blocks = x.reshape(lay["blocks"], BLOCK)
    absmax = blocks.abs().max(dim=-1)[0]
    q = torch.bucketize(scaled(blocks, absmax.view(-1, 1)).reshape(-1), midpoints(levels),
                        right=False).to(torch.uint8)
    pairs = (q[0::2] << 4) | q[1::2]
    offset = mean_f64(absmax)
    centred = absmax - torch.tensor(offset, dtype=torch.float32)
    scales, codes = [], []
    for g in range(lay["groups"]):
        part = centred[g * SCALE_BLOCK:(g + 1) * SCALE_BLOCK]
        s = part.abs().max()
        scales.append(s)
        codes.append(torch.bucketize(scaled(part, s), midpoints(dyn), right=False))
    scales = torch.stack(scales).to(torch.float32)
    codes = torch.cat(codes).to(torch.uint8)
    buf = bytearray(lay["bytes"])
    buf[0:4 * lay["groups"]] = scales.numpy().astype("<f4").tobytes()
    buf[lay["offset_at"]:lay["offset_at"] + 4] = np.array([offset], dtype="<f4").tobytes()
    buf[lay["codes_at"]:lay["codes_at"] + lay["blocks"]] = codes.numpy().tobytes()
    buf[lay["packed_at"]:lay["packed_at"] + n // 2] = pairs.numpy().tobytes()
    return dict(layout=lay, absmax=absmax, offset=offset, scales=scales, codes=codes, q=q,
                pairs=pairs, bytes=bytes(buf))


def unpack(buf, n):
    """The pieces of a packed buffer (any producer's)."""
    lay = layout(n)
    raw = np.frombuffer(buf, dtype=np.uint8)
    scales = torch.from_numpy(raw[0:4 * lay["groups"]].copy().view("<f4").astype(np.float32))
    offset = raw[lay["offset_at"]:lay["offset_at"] + 4].copy().view("<f4")[0]
    codes = torch.from_numpy(raw[lay["codes_at"]:lay["codes_at"] + lay["blocks"]].copy())
    pairs = torch.from_numpy(raw[lay["packed_at"]:lay["packed_at"] + n // 2].copy())
    q = torch.empty(n, dtype=torch.uint8)
    q[0::2] = pairs >> 4
    q[1::2] = pairs & 0xF
    return dict(layout=lay, scales=scales, offset=np.float32(offset), codes=codes, pairs=pairs,
                q=q)


def block_absmax_f32(pieces, dyn):
    """DYN[c] * s + offset, each operation rounded to f32 (bitsandbytes' dequantize_blockwise,
    then `absmax += offset`)."""
    lay = pieces["layout"]
    group = torch.arange(lay["blocks"]) // SCALE_BLOCK
    s = pieces["scales"][group]
    product = dyn[pieces["codes"].long()] * s
    return product + torch.tensor(pieces["offset"], dtype=torch.float32)


def dequantize_f32(pieces, levels, dyn):
    absmax = block_absmax_f32(pieces, dyn)
    values = levels[pieces["q"].long()].reshape(-1, BLOCK)
    return (values * absmax.view(-1, 1)).reshape(-1)


def dequantize_f64(pieces, levels, dyn):
    """The same formula in float64, and a bound on the f32 evaluation's rounding error."""
    lay = pieces["layout"]
    group = torch.arange(lay["blocks"]) // SCALE_BLOCK
    s = pieces["scales"].double()[group]
    product = dyn.double()[pieces["codes"].long()] * s
    offset = float(pieces["offset"])
    absmax = product + offset
    values = levels.double()[pieces["q"].long()].reshape(-1, BLOCK)
    exact = (values * absmax.view(-1, 1)).reshape(-1)
    # Three f32 roundings (product, sum, product), each <= 2^-24 relative to what it rounds;
    # the sum's relative to |product| + |offset| (no cancellation assumed).
    u = 2.0 ** -24
    scale = (values.abs() * (product.abs() + abs(offset)).view(-1, 1)).reshape(-1)
    bound = 3.001 * u * scale
    return exact, bound


def to_bits_bf16(t):
    return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def to_bits_f16(t):
    return t.to(torch.float16).numpy().view(np.uint16)


def bits_f32(t):
    return t.to(torch.float32).numpy().view(np.uint32)


# ---- reading the directory


def read(directory, name, dtype):
    return np.fromfile(os.path.join(directory, name), dtype=dtype)


def describe_byte_diff(want, got, lay):
    """Where two packed buffers first differ, and how many bytes differ per field."""
    w = np.frombuffer(want, dtype=np.uint8)
    g = np.frombuffer(got, dtype=np.uint8)
    if w.size != g.size:
        return f"size {g.size} != {w.size}"
    fields = [("s", 0, lay["offset_at"]), ("offset", lay["offset_at"], lay["codes_at"]),
              ("c", lay["codes_at"], lay["packed_at"]),
              ("q", lay["packed_at"], lay["packed_at"] + lay["n"] // 2),
              ("padding", lay["packed_at"] + lay["n"] // 2, lay["bytes"])]
    parts = []
    for name, a, b in fields:
        diff = np.nonzero(w[a:b] != g[a:b])[0]
        if diff.size:
            parts.append(f"{name}: {diff.size} bytes differ, first at +{diff[0]} "
                         f"(want {w[a + diff[0]]:#04x}, got {g[a + diff[0]]:#04x})")
    return "; ".join(parts)


def compare_bits(label, want, got, problems, values=None):
    want = np.asarray(want)
    got = np.asarray(got)
    if want.shape != got.shape:
        problems.append(f"{label}: {got.shape} elements, want {want.shape}")
        return
    diff = np.nonzero(want != got)[0]
    if diff.size:
        i = diff[0]
        extra = f" (value {values[i]!r})" if values is not None else ""
        problems.append(f"{label}: {diff.size} differ, first at {i}: want {int(want[i]):#x}, "
                        f"got {int(got[i]):#x}{extra}")


def check_tables(directory, index):
    """The C++ tables against the definitions; returns (problems, levels, dynamic map) where the
    tables returned are the ones the cases are checked with (computed here, never read)."""
    problems = []
    cpp_levels = read(directory, index["levels"], "<f4").astype(np.float32)
    cpp_dyn = read(directory, index["dynamic_map"], "<f4").astype(np.float32)
    ref = normal_map_f64()
    worst = max(abs(float(a) - b) for a, b in zip(cpp_levels, ref))
    if len(cpp_levels) != 16 or worst > 1e-7:
        problems.append(f"NF4 levels differ from the normal quantiles by {worst:.3e} (> 1e-7)")
    levels, fused = definition_tables()
    exact = np.array_equal(levels.numpy().view(np.uint32), cpp_levels.view(np.uint32))
    print(f"tables: NF4 levels within {worst:.2e} of create_normal_map in float64; "
          f"create_normal_map's f32 arithmetic gives the C++ table "
          f"{'bit for bit' if exact else 'NOT bit for bit'}")
    if not exact:
        problems.append("NF4 levels: create_normal_map's f32 arithmetic gives "
                        f"{levels.tolist()}, the C++ table is {cpp_levels.tolist()}")
    # The dynamic map: this torch's linspace (the definition), and torch's kernel written out.
    by_torch = dynamic_map_f32()
    rounded = dynamic_map_f32(lambda steps: linspace_formula(steps, fused=False))

    def differ(a, b):
        return int((a.numpy().view(np.uint32) != np.asarray(b).view(np.uint32)).sum())

    which = (" (= the kernel's formula with separate f32 roundings)" if differ(rounded, cpp_dyn) == 0
             else " (= the kernel's formula with fused multiply-adds)" if differ(fused, cpp_dyn) == 0
             else " (= neither written-out formula)")
    torch_which = ("separate roundings" if differ(by_torch, rounded.numpy()) == 0 else
                   "fused multiply-adds" if differ(by_torch, fused.numpy()) == 0 else
                   "neither written-out formula (a vectorised path)")
    # The definition: torch 2's linspace (one rounding per value, a fused multiply-add), as
    # current bitsandbytes builds its map; this torch's own linspace is reported alongside.
    n = differ(fused, cpp_dyn)
    if n:
        diff = np.nonzero(fused.numpy().view(np.uint32) != cpp_dyn.view(np.uint32))[0]
        problems.append(f"dynamic map: {n} of 256 entries differ from create_dynamic_map with "
                        f"torch 2's fused linspace, first at {diff[0]}: C++ {cpp_dyn[diff[0]]!r}, "
                        f"definition {fused[diff[0]].item()!r}; the C++ table{which}")
    else:
        print("tables: dynamic map equals create_dynamic_map(signed=True) with torch 2's fused "
              "linspace bit for bit")
    print(f"tables: this torch {torch.__version__}'s own linspace is {torch_which}; its map "
          f"differs from the definition in {differ(by_torch, fused.numpy())} of 256 entries")
    dyn = fused
    return problems, levels, dyn, by_torch


def check_case(directory, case, levels, dyn):
    """The definition against meshtrain's files for one case; returns (problems, data)."""
    n = case["n"]
    x = torch.from_numpy(read(directory, case["x"], "<f4").astype(np.float32))
    packed = read(directory, case["packed"], np.uint8).tobytes()
    problems = []
    if x.numel() != n:
        return [f"input has {x.numel()} elements, index says {n}"], None
    want = quantize(x, levels, dyn)
    if packed != want["bytes"]:
        problems.append("packed bytes: " + describe_byte_diff(want["bytes"], packed,
                                                                 want["layout"]))
    pieces = unpack(packed, n)  # dequantise meshtrain's own buffer: checks dequant alone
    deq32 = dequantize_f32(pieces, levels, dyn)
    compare_bits("nf4::dequantize f32", bits_f32(deq32),
                 read(directory, case["deq"], "<u4"), problems)
    exact, bound = dequantize_f64(pieces, levels, dyn)
    err = (deq32.double() - exact).abs()
    over = torch.nonzero(err > bound).flatten()
    if over.numel():
        i = over[0].item()
        problems.append(f"f32 dequant vs float64: {over.numel()} beyond 3 roundings, first at "
                        f"{i}: {deq32[i].item()!r} vs {exact[i].item()!r}")
    rel = (err / exact.abs().clamp(min=1e-300))[exact != 0]
    worst_rel = rel.max().item() if rel.numel() else 0.0
    compare_bits("backend f32", bits_f32(deq32), read(directory, case["op_f32"], "<u4"),
                 problems)
    compare_bits("backend bf16", to_bits_bf16(deq32), read(directory, case["op_bf16"], "<u2"),
                 problems)
    compare_bits("backend f16", to_bits_f16(deq32), read(directory, case["op_f16"], "<u2"),
                 problems)
    return problems, dict(x=x, packed=packed, want=want, pieces=pieces, deq32=deq32,
                          worst_rel=worst_rel)


# ---- bitsandbytes itself


def import_bitsandbytes():
    try:
        import bitsandbytes.functional as F  # noqa: N812
    except Exception as e:  # ImportError, or a broken native library
        print(f"SKIPPED: bitsandbytes not importable ({type(e).__name__}: {e})")
        sys.exit(77)
    return F


def lut_codes(values, code, zero):
    """bitsandbytes' native CPU quantize_blockwise, for explaining mismatches: a 65536-entry
    table over [-1, 1] (csrc/cpu_ops.cpp build_quantize_lut / norm_to_lut_index) instead of
    bucketize, and code 0 for a block whose absmax is 0 (`zero`: those rows)."""
    mids = midpoints(code)
    grid = -1.0 + (2.0 * torch.arange(65536, dtype=torch.float32)) / 65535
    lut = torch.searchsorted(mids, grid, right=False)  # the number of midpoints below
    v = torch.where(zero, torch.zeros_like(values), values).clamp(-1, 1)  # 0 / 0 there
    idx = ((v + 1.0) * 0.5 * 65535 + 0.5).to(torch.int64)
    out = lut[idx].to(torch.uint8)
    out[zero] = 0
    return out


def bitsandbytes_emulated(absmax, dyn):
    """The second level as bitsandbytes 0.50 computes it on CPU with its native library:
    offset = torch's f32 mean, s per 256, codes by lut_codes on `dyn`."""
    offset = absmax.mean()
    centred = absmax - offset
    group = torch.arange(centred.numel()) // SCALE_BLOCK
    scales = torch.stack([centred[g * SCALE_BLOCK:(g + 1) * SCALE_BLOCK].abs().max()
                          for g in range((centred.numel() + SCALE_BLOCK - 1) // SCALE_BLOCK)])
    v = centred * (1.0 / scales)[group]
    return np.float32(offset.item()), scales, lut_codes(v, dyn, scales[group] == 0)


def ulps(a, b):
    ia = np.array([a], dtype=np.float32).view(np.int32)[0]
    ib = np.array([b], dtype=np.float32).view(np.int32)[0]
    return int(ib) - int(ia)


def check_bitsandbytes(F, name, data, levels, dyn):  # noqa: N803
    """Fails on anything but bitsandbytes' known departures: its state must equal the
    definition with them applied, byte for byte, and its dequantisation the formula's."""
    problems, notes, departures = [], [], []
    x = data["x"]
    mine = data["pieces"]
    want = data["want"]
    packed, state = F.quantize_4bit(x.clone(), blocksize=BLOCK, compress_statistics=True,
                                    quant_type="nf4")
    b_pairs = packed.reshape(-1).to(torch.uint8)
    b_codes = state.absmax.reshape(-1).to(torch.uint8)
    b_scales = state.state2.absmax.reshape(-1).to(torch.float32)
    b_offset = np.float32(state.offset.item())
    b_dyn = state.state2.code.to(torch.float32).clone()
    # The tables bitsandbytes uses.
    compare_bits("bnb NF4 table", bits_f32(state.code.to(torch.float32)), bits_f32(levels),
                 problems)
    compare_bits("bnb dynamic map", bits_f32(state.state2.code.to(torch.float32)),
                 bits_f32(dyn), problems)
    compare_bits("bnb packed q", b_pairs.numpy(), mine["pairs"].numpy(), problems)
    torch_mean = np.float32(want["absmax"].mean().item())
    if b_offset != mine["offset"]:
        d = ulps(b_offset, mine["offset"])
        why = ("= torch's f32 mean of the absmax" if b_offset == torch_mean else
               f"!= torch's f32 mean {torch_mean!r} either")
        departures.append(f"bnb offset {b_offset!r} ({b_offset.view(np.uint32):#x}) != ours "
                        f"{mine['offset']!r} ({mine['offset'].view(np.uint32):#x}): {d:+d} ulp; "
                        f"bnb's {why}, ours the float64 mean "
                        f"{math.fsum(want['absmax'].tolist()) / want['absmax'].numel()!r}")
    else:
        notes.append(f"offset equal ({'torch f32 mean equal too' if torch_mean == b_offset else 'torch f32 mean differs: ' + repr(torch_mean)})")
    compare_bits("bnb state2.absmax (s)", bits_f32(b_scales), bits_f32(mine["scales"]),
                 departures)
    if not torch.equal(b_codes, mine["codes"]):
        diff = torch.nonzero(b_codes != mine["codes"]).flatten()
        i = diff[0].item()
        departures.append(f"bnb state.absmax (c): {diff.numel()} of {b_codes.numel()} codes differ, "
                        f"first at block {i}: bnb {b_codes[i].item()}, ours "
                        f"{mine['codes'][i].item()}")
    # Is bitsandbytes' state the definition with its three known departures, byte for byte?
    e_offset, e_scales, e_codes = bitsandbytes_emulated(want["absmax"], b_dyn)
    same = (e_offset == b_offset and torch.equal(e_scales, b_scales)
            and torch.equal(e_codes, b_codes) and torch.equal(b_pairs, want["pairs"]))
    notes.append(f"bnb's state {'==' if same else '!='} the definition with torch's f32 mean, its "
                 "native 65536-entry LUT (code 0 where s = 0) and its torch's dynamic map")
    if same:
        if departures:
            notes.append("explained departures: " + "; ".join(departures))
    else:
        problems.append(notes.pop() + f" (offset {e_offset == b_offset}, s "
                        f"{torch.equal(e_scales, b_scales)}, codes "
                        f"{int((e_codes != b_codes).sum())} differ)")
        problems.extend(departures)
    # Dequantisation by bitsandbytes of its own state (f32, and bf16 by the state's dtype)
    # against the formula applied to that state.
    b_pieces = {"q": want["q"], "codes": b_codes, "scales": b_scales, "offset": b_offset,
                "layout": want["layout"]}
    formula32 = dequantize_f32(b_pieces, levels, b_dyn)
    b32 = F.dequantize_4bit(packed, state).reshape(-1)
    compare_bits("bnb dequantize_4bit f32 (bnb's state)", bits_f32(b32), bits_f32(formula32),
                 problems)
    state.dtype = torch.bfloat16
    b16 = F.dequantize_4bit(packed, state).reshape(-1)
    compare_bits("bnb dequantize_4bit bf16 (bnb's state)",
                 b16.view(torch.int16).numpy().view(np.uint16), to_bits_bf16(formula32),
                 problems)
    # bitsandbytes dequantising meshtrain's buffer: the formula alone, whatever the state.
    state.dtype = torch.float32
    state.absmax = mine["codes"].clone()
    state.state2.absmax = mine["scales"].clone()
    state.offset = torch.tensor(mine["offset"], dtype=torch.float32)
    state.state2.code = dyn.clone()  # the map meshtrain's codes index
    ours = F.dequantize_4bit(mine["pairs"].clone().reshape(-1, 1), state).reshape(-1)
    compare_bits("bnb dequantize_4bit f32 of meshtrain's state", bits_f32(ours),
                 bits_f32(data["deq32"]), problems)
    state.dtype = torch.bfloat16
    ours16 = F.dequantize_4bit(mine["pairs"].clone().reshape(-1, 1), state).reshape(-1)
    compare_bits("bnb dequantize_4bit bf16 of meshtrain's state",
                 ours16.view(torch.int16).numpy().view(np.uint16), to_bits_bf16(data["deq32"]),
                 problems)
    return problems, notes


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dir")
    parser.add_argument("--bitsandbytes", action="store_true",
                        help="also compare with bitsandbytes (exit 77 when not importable)")
    args = parser.parse_args()
    F = import_bitsandbytes() if args.bitsandbytes else None  # noqa: N806
    torch.set_num_threads(1)
    with open(os.path.join(args.dir, "index.json")) as f:
        index = json.load(f)
    problems, levels, dyn, torch_dyn = check_tables(args.dir, index)
    for p in problems:
        print(f"tables: MISMATCH: {p}")
    failed = bool(problems)
    for case in index["cases"]:
        case_problems, data = check_case(args.dir, case, levels, dyn)
        line = f"{case['name']} n={case['n']}"
        if data is not None:
            line += f" (f32 dequant within {data['worst_rel']:.1e} rel. of float64)"
        if data is not None and not torch.equal(dyn, torch_dyn):
            # What this torch's dynamic map would change (already a failure above).
            alt = quantize(data["x"], levels, torch_dyn)
            alt32 = dequantize_f32(unpack(alt["bytes"], case["n"]), levels, torch_dyn)
            own32 = dequantize_f32(unpack(data["want"]["bytes"], case["n"]), levels, dyn)
            codes = int((alt["codes"] != data["want"]["codes"]).sum())
            values = int((bits_f32(alt32) != bits_f32(own32)).sum())
            line += (f" [with torch {torch.__version__}'s dynamic map: {codes} block codes and "
                     f"{values} f32 values would differ]")
        if case_problems:
            failed = True
            print(f"{line}: MISMATCH: " + "; ".join(case_problems))
        else:
            print(f"{line}: definition OK (packed bytes, f32/bf16/f16 bits)")
        if F is not None and data is not None:
            bnb_problems, notes = check_bitsandbytes(F, case["name"], data, levels, dyn)
            if bnb_problems:
                failed = True
                print(f"{case['name']}: bitsandbytes MISMATCH: " + "; ".join(bnb_problems)
                      + (f" [{'; '.join(notes)}]" if notes else ""))
            else:
                print(f"{case['name']}: bitsandbytes OK: level-1 bytes equal, the rest equal up to its known departures ({'; '.join(notes)})")
    print("FAIL" if failed else "PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
