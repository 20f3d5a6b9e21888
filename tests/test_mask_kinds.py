"""Each MaskTerm kind is one object (``lowerings/mask_kinds.py``): the registry is complete,
and each kind's reference piece, skip rule, operand check and launch arguments agree with a
dense float64 evaluation of the term on tiny examples (dense key positions, chunks, and
gathered key indices as the sparse backward and the attention pass them)."""
import inspect
import math
import pathlib
import re

import pytest
import torch

from hyscale_compile.lowerings import mask_kinds as mk
from hyscale_compile.lowerings.spec import MaskTerm, ScoreSpec, SpecError

from tests.contract import fresh_seed

ROOT = pathlib.Path(__file__).resolve().parents[1]
B, S, T = 2, 3, 7


def _rows(seed, shape=(B, S)):
    """Per-row int64 bounds in [-1, T + 1] (out-of-range bounds included)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, T + 2, shape, generator=g)


def _cases(seed):
    """(name, term, operands) covering every kind, mode, polarity and broadcast form."""
    g = torch.Generator().manual_seed(seed)
    add = torch.randn(B, S, T, generator=g, dtype=torch.float64)
    add[0, 1, 2] = -math.inf
    hidden = torch.rand(B, S, T, generator=g) < 0.4
    return [
        ("add", MaskTerm("add", operand=0), [add]),
        ("add_bcast_bf16", MaskTerm("add", operand=0), [torch.randn(1, S, T, generator=g).to(torch.bfloat16)]),
        ("fill_ninf", MaskTerm("fill", operand=0), [hidden]),
        ("fill_false_finite", MaskTerm("fill", operand=0, where=False, value=-1e4), [hidden]),
        ("fill_bcast_keys", MaskTerm("fill", operand=0, value=2.5), [hidden[0, 0]]),
        ("range_hi", MaskTerm("range", hi=0), [_rows(seed)]),
        ("range_lo_hi_add", MaskTerm("range", lo=0, hi=1, mode="add", value=-1e9),
         [_rows(seed + 1), _rows(seed + 2)]),
        ("range_lo_bcast_add_ninf", MaskTerm("range", lo=0, mode="add"), [_rows(seed + 3, (B, 1))]),
        ("range_add_pinf", MaskTerm("range", hi=0, mode="add", value=math.inf), [_rows(seed + 4)]),
        ("range_none", MaskTerm("range", value=7.0), []),
    ]


def _dense(term, y, ops):
    """The term on y [B, S, T] float64, element by element: the MaskTerm docstring's rule."""
    out = y.clone()
    for b in range(B):
        for s in range(S):
            for t in range(T):
                x = float(y[b, s, t])
                if term.kind == "add":
                    x = x + float(torch.broadcast_to(ops[term.operand], (B, S, T))[b, s, t])
                elif term.kind == "fill":
                    if bool(torch.broadcast_to(ops[term.operand], (B, S, T))[b, s, t]) == term.where:
                        x = term.value
                else:
                    lo = 0 if term.lo is None else int(torch.broadcast_to(ops[term.lo], (B, S))[b, s])
                    hi = T if term.hi is None else int(torch.broadcast_to(ops[term.hi], (B, S))[b, s])
                    if not lo <= t < hi:
                        x = term.value if term.mode == "fill" else x + term.value
                out[b, s, t] = x
    return out


def _same(got, want):
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_registry_is_complete():
    # every kind the matcher emits, the MaskTerm docstring describes and the spec accepts
    # has one concrete class carrying every piece
    emitted = set(re.findall(r'MaskTerm\("(\w+)"', (ROOT / "passes" / "canonicalize.py").read_text()))
    documented = set(re.findall(r'kind="(\w+)":', MaskTerm.__doc__))
    assert emitted == documented == set(mk.KINDS), (emitted, documented, set(mk.KINDS))
    for name, cls in mk.KINDS.items():
        assert cls.name == name and issubclass(cls, mk.MaskKind)
        assert not inspect.isabstract(cls), f"{cls.__name__} lacks {sorted(cls.__abstractmethods__)}"
    seen = set()
    for _, term, ops in _cases(1):
        kind = mk.kind_of(term, 0)
        seen.add(type(kind))
        ScoreSpec(post=(("mask", 0),), masks=(term,)).validate(num_mask_operands=len(ops))
        assert MaskTerm.from_json(kind.to_json()) == term
        for lines in (kind.args(), kind.tile_args(), kind.row_loads(), kind.row_values(), kind.slot_params(),
                      kind.slot_row_loads(), kind.apply_lines(), kind.slot_lines(), kind.key_clamp_lines()):
            assert isinstance(lines, list) and all(isinstance(ln, str) for ln in lines)
        assert [i for i, _ in kind.operand_roles()] == list(term.operands)
    assert seen == set(mk.KINDS.values())
    with pytest.raises(SpecError, match=r"mask kind 'causal'; expected one of \('add', 'fill', 'range'\)"):
        ScoreSpec(post=(("mask", 0),), masks=(MaskTerm("causal"),)).validate()


@pytest.mark.parametrize("case", [c[0] for c in _cases(0)])
def test_reference_piece_matches_dense_float64(case):
    seed = fresh_seed(f"mask kind reference {case}")
    name, term, ops = next(c for c in _cases(seed) if c[0] == case)
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(B, S, T, generator=g, dtype=torch.float64) * 4
    y[1, 2, 3] = math.inf
    y[0, 0, 0] = -math.inf
    want = _dense(term, y, ops)
    kind = mk.kind_of(term, 0)
    # dense key positions: the whole table, then one block of rows and keys
    _same(kind.reference(y, ops, 0, B, 0, S, 0, T, B, S, T), want)
    _same(kind.reference(y[1:2, 1:3, 2:6], ops, 1, 2, 1, 3, 2, 6, B, S, T), want[1:2, 1:3, 2:6])
    # gathered key indices [b, s, n] (the sparse backward), repeats and any order included
    keys = torch.randint(0, T, (B, S, 5), generator=g)
    _same(kind.reference(y.gather(-1, keys), ops, 0, B, 0, S, 0, T, B, S, T, keys=keys), want.gather(-1, keys))
    # the attention's layout: one batch row, y [heads, n, K] and keys [1, n, K]
    b, H = 1, 2
    yh = torch.stack([y[b], -y[b]])  # [H, S, T]
    kb = keys[b:b + 1, :, :4]
    got = kind.reference(yh.gather(-1, kb.expand(H, -1, -1)), ops, b, b + 1, 0, S, 0, T, B, S, T, keys=kb)
    wanth = torch.stack([_dense(term, torch.stack([yh[h]] * B), ops)[b] for h in range(H)])
    _same(got, wanth.gather(-1, kb.expand(H, -1, -1)))


@pytest.mark.parametrize("case", [c[0] for c in _cases(0)])
def test_skip_rule_agrees_with_reference(case):
    seed = fresh_seed(f"mask kind skip {case}")
    name, term, ops = next(c for c in _cases(seed) if c[0] == case)
    kind = mk.kind_of(term, 0)
    ninf = torch.full((B, S, T), -math.inf, dtype=torch.float64)
    got = kind.reference(ninf, ops, 0, B, 0, S, 0, T, B, S, T)
    if kind.keeps_neg_inf():
        assert torch.isneginf(got).all()
    elif term.kind != "range" or not kind.hides_nothing():
        # the rule is exact: some operand (every key hidden) lifts -inf
        every = {"add": [torch.zeros(B, S, T, dtype=torch.float64)], "fill": [torch.full((B, S, T), term.where)],
                 "range": [torch.full((B, S), T + 1 if i == term.lo else 0) for i in range(len(ops))]}[term.kind]
        assert not torch.isneginf(kind.reference(ninf, every, 0, B, 0, S, 0, T, B, S, T)).all()
    # which keys a range term hides: the dense rule with a NaN fill
    hidden = torch.isnan(_dense(MaskTerm("range", lo=term.lo, hi=term.hi, value=math.nan),
                                torch.zeros(B, S, T, dtype=torch.float64), ops)) if term.kind == "range" else None
    y = torch.randn(B, S, T, dtype=torch.float64) * 1e6
    if kind.skips_neg_inf():  # hidden keys are -inf whatever the (finite) score
        assert term.kind == "range" and torch.isneginf(kind.reference(y, ops, 0, B, 0, S, 0, T, B, S, T)[hidden]).all()
    fin = kind.finite_skip()
    if fin is not None:  # hidden keys hold exactly v in fp32 while every |score| < limit
        v, limit = fin
        y32 = (torch.rand(B, S, T, dtype=torch.float32) * 2 - 1) * min(limit, 3e38) * 0.999
        out = kind.reference(y32, ops, 0, B, 0, S, 0, T, B, S, T)
        assert out.dtype == torch.float32 and (out[hidden] == v).all() and (out[~hidden] > v).all()
    else:
        assert not (term.kind == "range" and math.isfinite(term.value) and term.value < 0 and not kind.hides_nothing())
    # a mask tensor reducible to row ranges, and whether that needs a bound on the scores
    want = {"add": True, "add_bcast_bf16": True, "fill_ninf": False, "fill_false_finite": True}
    assert kind.table_ranges() == want.get(name)
    assert kind.added_operands() == ((0,) if term.kind == "add" else ())
    assert kind.positional == (term.kind == "range")
    if term.kind == "range":  # a block it proves hidden is: every row hides every key of it
        one_bound = len(term.operands) == 1  # (then exactly those blocks)
        for t0, t1 in ((0, 2), (3, 7), (6, 7)):
            got = kind.hides_block(ops, 0, B, 0, S, t0, t1, B, S)
            assert not got or hidden[..., t0:t1].all()
            assert not one_bound or got == bool(hidden[..., t0:t1].all())
        if one_bound:  # every row's bound 4: keys [4, T) hidden by hi, [0, 4) by lo
            four = [torch.full((B, S), 4)]
            assert kind.hides_block(four, 0, B, 0, S, 4, T, B, S) == (term.hi is not None)
            assert kind.hides_block(four, 0, B, 0, S, 0, 4, B, S) == (term.lo is not None)


def test_operand_checks_name_the_problem():
    rows, table = torch.zeros(B, S, dtype=torch.int64), torch.zeros(B, S, T)
    check = mk.check_mask_operands
    with pytest.raises(SpecError, match=r"mask operand 0 \(the range term's hi bound\) has shape \(2, 5\); "
                                        r"it must broadcast to \[B, S\] = \(2, 3\)"):
        check([MaskTerm("range", hi=0)], [torch.zeros(2, 5, dtype=torch.int64)], B, S, T)
    with pytest.raises(SpecError, match=r"mask operand 0 \(a fill mask\) has shape \(2, 3, 8\); it must "
                                        r"broadcast to \[B, S, T\] = \(2, 3, 7\)"):
        check([MaskTerm("fill", operand=0)], [torch.zeros(B, S, T + 1, dtype=torch.bool)], B, S, T)
    for term, op, msg in ((MaskTerm("add", operand=0), table.bool(), r"\(add\): operand 0 has dtype torch.bool; "
                                                                       "expected a real, non-bool dtype"),
                          (MaskTerm("fill", operand=0), table, r"\(fill\): operand 0 has dtype torch.float32; "
                                                               "expected bool"),
                          (MaskTerm("range", lo=0), rows.float(), r"\(range\): bound operand 0 has dtype "
                                                                 "torch.float32; expected an integer dtype")):
        with pytest.raises(SpecError, match=r"mask term 0 " + msg):
            check([term], [op], B, S, T)
    check([MaskTerm("add", operand=0), MaskTerm("range", lo=1, hi=1)], [table.long(), rows], B, S, T)
    with pytest.raises(SpecError, match=r"mask term 1 \(range\): operand 1 is on meta, q on cpu"):
        check([MaskTerm("add", operand=0), MaskTerm("range", lo=1)], [table, rows.to("meta")], B, S, T,
              torch.device("cpu"))


def test_launch_args_are_views_in_declared_order():
    table = torch.randn(1, S, T)
    hidden = torch.rand(B, 1, T) < 0.5
    lo, hi = torch.zeros(S, dtype=torch.int64), torch.full((B, 1), T, dtype=torch.int32)
    terms = [MaskTerm("add", operand=0), MaskTerm("fill", operand=1), MaskTerm("range", lo=2, hi=3)]
    ops = [table, hidden, lo, hi]
    cpu = torch.device("cpu")
    args = mk.mask_launch_args(terms, ops, B, S, T, cpu, rows=slice(1, 3))
    assert len(args) == sum(len(k.args()) for k in mk.mask_kinds(terms)) == 4 + 4 + 6
    m, mb, ms, mt = args[:4]
    storage = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    assert storage(m) == storage(table) and m.shape == (B, 2, T) and (mb, ms, mt) == (0, T, 1)
    assert m.storage_offset() == T  # row 1 of the broadcast view, no copy
    assert args[4].dtype == torch.uint8 and storage(args[4]) == storage(hidden) and args[5:8] == [T, 0, 1]
    assert args[8].shape == (B, 2) and args[9:11] == [0, 1] and args[12:14] == [1, 0]
    # the selection kernel upcasts any real additive mask; the attention kernel only 16/32-bit floats
    ints = [table.long(), *ops[1:]]
    mk.mask_launch_args(terms, ints, B, S, T, cpu)
    with pytest.raises(SpecError, match="additive mask operand 0 has dtype torch.int64; the kernel adds fp32"):
        mk.mask_launch_args(terms, ints, B, S, T, cpu, float_adds=True)
    with pytest.raises(SpecError, match="additive mask operand 0 is float64"):
        mk.mask_launch_args(terms, [table.double(), *ops[1:]], B, S, T, cpu)
    with pytest.raises(SpecError, match=r"range bound operand 3 of shape \(3, 1\) does not broadcast to \[B, S\]"):
        mk.mask_launch_args(terms, [*ops[:3], torch.zeros(3, 1, dtype=torch.int64)], B, S, T, cpu)
    with pytest.raises(SpecError, match="mask operand 1 is on meta, expected cpu"):
        mk.mask_launch_args(terms, [table, hidden.to("meta"), lo, hi], B, S, T, cpu)
