"""The MLA form of a rewritten attention: MQA over the shared latent, up-projections absorbed.

In MLA (HF DeepseekV32 / GlmMoeDsa ``expand_kv``, DeepSeek's MLA) the per-head keys and
values are up-projections of one latent per token::

    kv = (latent @ W^T).view(B, T, H, E)        W: [H*E, R], E >= Dn + Dv (kv_b_proj)
    k_nope, v = kv[..., o_k:o_k+Dn], kv[..., o_v:o_v+Dv]
    k = [k_nope | k_rot expanded over heads]     (new_empty + two copy_ into slices, or cat)

so for every head h, with W_kb_h = W[h*E+o_k : +Dn]^T [R, Dn] and W_vb_h likewise:

    q_h . k_h = (q_pass_h W_kb_h^T) . latent + q_rot_h . k_rot
    out_h     = (sum_j P_hj latent_j) W_vb_h

and the attention runs as MQA (one key head shared by all H heads, ``form_of(H, 1)``)
over ``[latent | k_rot]`` [B, T, 1, R + Dr] with ``v = latent`` (a view of it), the key
up-projection absorbed into the query (a bmm over heads before the op) and the value
up-projection applied to the op's output (a bmm over heads after it). The per-head K/V
expansion then has no reader.

``find_latent`` proves the structure from the graph: it replays the view ops between the
attention's canonical k / v and the ``mm`` that up-projects the latent on a contiguous fake
tensor and reads the strides, so a view chain that does not index the up-projection as
[b*T + t, h*E + e] is rejected (the attention then runs per head, with the reason).

**The static rule** (shapes only, fixed at compile time; never timing): the absorbed form
runs when it reads fewer bytes per query than the per-head form:

    latent:   k * (R * size(latent) + Dr * size(k_rot))
    per head: k * H * (Dqk * size(k) + Dv * size(v))

(DeepSeek: 576 elements against 128 * 320; a single head, or value heads as wide as the
latent, stay per head). Rounding: the absorbed query ``q_pass W_kb`` is computed in the
dtype of q and W (rounded to bf16 in a bf16 model, as FlashMLA does); the op's output
over the latent is rounded to the attention's output dtype before the value projection.
The tests check both against the numerics rule of docs/contract.md.

Keys multiplied by a scalar known at compile time (sdpa's math path multiplies q and k
each by sqrt(scale) before the matmul, after upcasting bf16/fp16 to fp32; exact upcasts are
stepped over too) are the up-projection times that factor: the factor moves to the query,
applied before the absorption in the query's dtype (in bf16 the original rounds each k * c,
the absorbed form each q * c instead), and explain records it as ``key_scale``. A factor
known only at run time keeps the attention per head, with the reason.

explain records the form as "mqa over the latent (absorbed)" with R, Dr and the rule's
byte counts, or "per_head" with the reason under ``latent``.

**Keys only** (``absorb(em, q, k, None)``: the indexer loss's target, ``passes/indexer_loss.py``,
reads the op's probabilities, not its output): only the keys must be up-projections; the
rule counts the keys' bytes alone, and the op's v is the latent view all the same.

**Training** (``rewrite_backward``): the backward of the attention *and* of the per-head
expansion (the slice writes, the split, the up-projection's mm) becomes the absorbed
form's: dOut -> d out_lat (bmm with W_vb) and dW_vb; ``sparse_attention_backward`` -> d
q_cat and d latent (its key part plus its value view); d q_pass (bmm with W_kb^T) and
dW_kb; d k_rot once per token (what the expand's backward sums). The region is found by
the gradient's flow from the value contraction's backward to the gradients of q, the
latent, the weight and k_rot; where another gradient enters it or one of its nodes is read
elsewhere, the attention runs per head and explain says why. Through a fused sdpa node
(written out as its math by ``passes/sdpa.py``: HF's default ``attn_implementation="sdpa"``)
the region is the same, with the fused backward node in it: the gradient enters as that of
the node's [B, H, S, Dv] output (a row-major view of the value contraction) and the node
hands out the gradients of q, k and v together, told apart by position.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, List, Optional, Tuple

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .canonicalize import Unsupported, shape_of, val
from .partition import tag_recompute

aten = torch.ops.aten

FORM = "mqa over the latent (absorbed)"

# Ops whose output indexes its input by an affine map (replayed on a fake tensor).
_REPLAY = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
    aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.expand.default, aten.slice.Tensor, aten.select.int,
}
_IDENTITY = {aten.clone.default, aten.alias.default, aten.detach.default, aten.contiguous.default}
_SPLITS = {aten.split_with_sizes.default, aten.split.Tensor}
_RESHAPES = {aten._unsafe_view.default, aten.reshape.default}


def _eq(a, b) -> bool:
    return statically_known_true(a == b)


def _contiguous_strides(shape) -> List[Any]:
    out, s = [], 1
    for d in reversed(shape):
        out.append(s)
        s = s * d
    return list(reversed(out))


_MULS = {aten.mul.Tensor, aten.mul.Scalar}


def _exact_cast(n: fx.Node) -> bool:
    """A cast that keeps every value (bf16/fp16 -> fp32, a float -> fp64; sdpa's math path
    upcasts its operands so): it changes no index map, and the latent form reads the
    uncast tensors (promoting where it meets wider operands)."""
    if n.target is not torch.ops.prims.convert_element_type.default:
        return False
    src, dst = val(n.args[0]), val(n)
    if not (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)):
        return False
    a, b = src.dtype, dst.dtype
    return a == b or (b == torch.float32 and a in (torch.float16, torch.bfloat16)) or \
        (b == torch.float64 and a.is_floating_point)


def _constant_scalar(x) -> Optional[float]:
    """The value of a scalar factor known at compile time (a Python number, a constant
    SymFloat, a 0-d tensor the graph builds from one or holds as a constant), else None."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, (torch.SymInt, torch.SymFloat)):
        return float(x) if x.node.is_constant() else None
    if not isinstance(x, fx.Node) or not isinstance(val(x), torch.Tensor) or val(x).dim() != 0:
        return None
    if x.target in (aten.scalar_tensor.default, aten.full.default) or x.target in _IDENTITY or _exact_cast(x) or \
            x.target is aten.lift_fresh_copy.default:
        if x.target is aten.full.default:
            return _constant_scalar(x.args[1]) if list(x.args[0]) == [] else None
        return _constant_scalar(x.args[0])
    if x.op == "get_attr":
        gm = x.graph.owning_module
        t = getattr(gm, x.target, None) if gm is not None else None
        if isinstance(t, torch.Tensor) and t.dim() == 0 and not isinstance(t, torch._subclasses.FakeTensor) \
                and t.device.type != "meta":
            with unset_fake_temporarily():  # (the passes run under the graph's fake mode)
                return float(t.item())
    return None


def _scale_of(n: fx.Node) -> Tuple[fx.Node, float]:
    """(x, c) for ``n = x * c`` with ``c`` a scalar known at compile time (the keys scaled
    before the score matmul, as sdpa's math path does with sqrt(scale)); Unsupported for a
    factor known only at run time or a product that is not by a scalar."""
    a, b = n.args[0], n.args[1]
    x, c = (a, b) if isinstance(a, fx.Node) and shape_of(a) == shape_of(n) else (b, a)
    if not isinstance(x, fx.Node) or shape_of(x) != shape_of(n):
        raise Unsupported(f"the keys are multiplied ({n.name}) by a tensor that broadcasts into them")
    if isinstance(c, fx.Node) and (not isinstance(val(c), torch.Tensor) or val(c).dim() != 0):
        raise Unsupported(f"the keys are multiplied ({n.name}) by a tensor, not a scalar")
    f = _constant_scalar(c)
    if f is None:
        name = c.name if isinstance(c, fx.Node) else str(c)
        raise Unsupported(f"the keys are multiplied ({n.name}) by a tensor known only at run time ({name})")
    if f != f or f in (float("inf"), float("-inf")):
        raise Unsupported(f"the keys are multiplied ({n.name}) by a factor that is not finite ({f})")
    if val(n).dtype != val(x).dtype:
        raise Unsupported(f"the keys' product by a scalar ({n.name}) changes their dtype")
    return x, f


def _trace(n: fx.Node, fake_mode, factors: Optional[List[float]] = None) -> Tuple[fx.Node, torch.Tensor]:
    """(base, fake): walk back from ``n`` through views, slices and split outputs to the first
    other node; ``fake`` is ``n`` rebuilt from a contiguous fake of the base, so its strides
    and storage offset are the index map from ``n`` into the base (row-major). Exact upcasts
    are stepped over; with ``factors``, so are products by a compile-time scalar (they
    commute with the views), each factor appended to it."""
    ops, cur = [], n
    while isinstance(cur, fx.Node) and cur.op == "call_function":
        if cur.target in _REPLAY or cur.target in _IDENTITY:
            ops.append(cur)
            cur = cur.args[0]
        elif _exact_cast(cur):
            cur = cur.args[0]
        elif factors is not None and cur.target in _MULS:
            cur, f = _scale_of(cur)
            factors.append(f)
        elif cur.target is operator.getitem and isinstance(cur.args[0], fx.Node) and cur.args[0].target in _SPLITS:
            ops.append(cur)
            cur = cur.args[0].args[0]
        else:
            break
    base = val(cur)
    if not isinstance(base, torch.Tensor):
        raise Unsupported(f"no tensor metadata on {cur}")

    def meta(a):
        return fx.node.map_arg(a, lambda x: x.meta["val"])

    with fake_mode:
        f = torch.empty_strided(base.shape, _contiguous_strides(base.shape), dtype=base.dtype, device=base.device)
        for op in reversed(ops):
            if op.target in _IDENTITY:
                continue
            try:
                if op.target is operator.getitem:
                    sp = op.args[0]
                    f = sp.target(f, *meta(sp.args[1:]), **meta(dict(sp.kwargs)))[op.args[1]]
                elif op.target in _RESHAPES:
                    f = f.view(meta(op.args[1]))  # a reshape that would copy is no view: rejected
                else:
                    f = op.target(f, *meta(op.args[1:]), **meta(dict(op.kwargs)))
            except RuntimeError as e:
                raise Unsupported(f"{op.name} is not a view of {cur.name} ({str(e).splitlines()[0]})") from None
    return cur, f


@dataclasses.dataclass
class Latent:
    """What the absorbed rewrite needs (``find_latent``)."""

    rows: fx.Node  # [B*T, R]: the latent, rows b*T + t
    weight: fx.Node  # [R, H*E]: the up-projection's right operand (W^T)
    H: int
    E: int
    o_k: int  # the key part of each head's E columns: [o_k, o_k + Dn)
    Dn: int
    o_v: int  # the value part: [o_v, o_v + Dv)
    Dv: int
    nope: Tuple[int, int]  # where the key's up-projected part sits in Dqk
    rot: Tuple[int, int]  # where its per-token part sits
    rot_node: fx.Node  # the per-token part, expanded over heads
    rot_dims: List[Optional[int]]  # canonical k dim -> rot_node dim (None: a unit dim)
    R: int
    Dr: int
    # the keys are these up-projections times ``scale`` (a compile-time scalar, e.g. sdpa's
    # math path's sqrt(scale)); the absorbed form multiplies the query by it instead
    scale: float = 1.0


def _dim_map(fk: torch.Tensor, base_shape) -> List[Optional[int]]:
    """canonical dim -> base dim, when the canonical tensor is a permutation of the base's
    dims (unit dims aside), else Unsupported."""
    strides = _contiguous_strides(base_shape)
    out: List[Optional[int]] = []
    used = set()
    if not _eq(fk.storage_offset(), 0):
        raise Unsupported("the keys start inside their source tensor")
    for d, (size, st) in enumerate(zip(fk.shape, fk.stride())):
        if _eq(size, 1):
            out.append(None)
            continue
        js = [j for j in range(len(base_shape)) if j not in used and _eq(base_shape[j], size) and _eq(strides[j], st)]
        if len(js) != 1:
            raise Unsupported("the keys are not a permutation of their source tensor's dims")
        used.add(js[0])
        out.append(js[0])
    for j, s in enumerate(base_shape):
        if j not in used and not _eq(s, 1):
            raise Unsupported("the keys read part of a dim of their source tensor")
    return out


def _pieces(x: fx.Node, dim: int) -> List[Tuple[int, int, fx.Node]]:
    """[(start, end, node)]: ``x`` written along ``dim`` from disjoint pieces covering it
    (``cat``, or ``slice_scatter``s of ``copy``s into any base)."""
    rank = len(shape_of(x))
    size = shape_of(x)[dim]
    if not isinstance(size, int):
        raise Unsupported("the keys' head dim is dynamic")
    out = []
    if x.target is aten.cat.default:
        d = (x.args[1] if len(x.args) > 1 else x.kwargs.get("dim", 0)) % rank
        if d != dim:
            raise Unsupported("the keys are concatenated along another dim than the head dim")
        at = 0
        for t in x.args[0]:
            w = shape_of(t)[dim]
            out.append((at, at + w, t))
            at += w
        return out
    cur = x
    while isinstance(cur, fx.Node) and cur.target is aten.slice_scatter.default:
        a = list(cur.args) + [None] * (6 - len(cur.args))
        base, src, d, start, end, step = a[:6]
        d = 0 if d is None else d % rank
        start = 0 if start is None else start
        end = size if end is None else end
        if not (isinstance(start, int) and isinstance(end, int)) or d != dim or step not in (None, 1):
            raise Unsupported(f"{cur.name} does not write a static slice of the keys' head dim")
        start, end = (start + size if start < 0 else start), min(end + size if end < 0 else end, size)
        if src.target is aten.copy.default:
            if shape_of(src.args[1]) != shape_of(src) or val(src.args[1]).dtype != val(src).dtype:
                raise Unsupported(f"{src.name} broadcasts or casts into the keys")
            src = src.args[1]
        out.append((start, end, src))
        cur = base
    if not out:
        raise Unsupported(f"the keys ({x.name}, {x.target}) are not assembled from an up-projection and a "
                          "per-token part (cat or slice_scatter)")
    out.sort(key=lambda p: p[0])
    at = 0
    for s, e, _ in out:
        if s != at:
            raise Unsupported("the keys' slices overlap or leave a gap")
        at = e
    if at != size:
        raise Unsupported("the keys' slices do not cover the head dim")
    return out


def _check_rows(f: torch.Tensor, dims: List[Optional[int]], roles, C, E, what) -> Any:
    """``f`` (a view of the up-projection [B*T, H*E], laid out per ``dims``: canonical role ->
    f's dim) reads [b*T + t, h*E + o + e]; returns o."""
    B, T, H, _ = roles
    want = (T * C, C, E, 1)
    for r, (size, w) in enumerate(zip((B, T, H, None), want)):
        d = dims[r]
        if d is None or (size is not None and _eq(size, 1)):
            continue
        if not _eq(f.stride()[d], w):
            raise Unsupported(f"the {what} does not index the up-projection as [b*T + t, h*E + e]")
    o = f.storage_offset()
    if not isinstance(o, int):
        raise Unsupported(f"the {what}'s offset in each head is dynamic")
    return o


def find_latent(k: fx.Node, v: Optional[fx.Node], fake_mode) -> Latent:
    """Prove that the canonical ``k`` [B, T, H, Dqk] and ``v`` [B, T, H, Dv] are per-head
    up-projections of one latent by one weight, with the rest of k a per-token tensor
    expanded over the heads; Unsupported (with the reason) otherwise. ``v=None``: the keys
    only (an op whose output is not read: Dv = 0)."""
    B, T, H, Dqk = shape_of(k)
    Dv = shape_of(v)[3] if v is not None else 0
    if not isinstance(H, int) or H < 1:
        raise Unsupported("the number of heads is dynamic")
    factors: List[float] = []
    ksrc, fk = _trace(k, fake_mode, factors)
    scale = 1.0
    for f in factors:
        scale *= f
    kmap = _dim_map(fk, shape_of(ksrc))
    dd = kmap[3]
    if dd is None:
        raise Unsupported("the keys' head dim has size 1")
    nope = rot = None
    for s, e, p in _pieces(ksrc, dd):
        base, fp = _trace(p, fake_mode)
        if base.target is aten.mm.default:
            if nope is not None:
                raise Unsupported("two parts of the keys are up-projections")
            nope = (s, e, base, fp)
        elif H == 1 or kmap[2] is None or _eq(fp.stride()[kmap[2]], 0):  # the same for every head
            if rot is not None:
                raise Unsupported("the keys have more than two parts")
            rot = (s, e, p)
        else:
            raise Unsupported(f"a part of the keys ({p.name}) is neither an up-projection (mm) nor the same for "
                              "every head")
    if nope is None or rot is None:
        raise Unsupported("the keys are not [up-projection | per-token part]")
    s, e, Y, fp = nope
    lat, W = Y.args
    N, C = shape_of(Y)
    R = shape_of(lat)[1]
    if not isinstance(C, int) or C % H or not isinstance(R, int):
        raise Unsupported("the up-projection's width is not a static multiple of the heads")
    E = C // H
    if not _eq(N, B * T):
        raise Unsupported("the up-projection's rows are not the keys' (batch, token) rows")
    roles = (B, T, H, None)
    o_k = _check_rows(fp, kmap, roles, C, E, "key's up-projected part")
    Dn = e - s
    o_v = 0
    if v is not None:
        vsrc, fv = _trace(v, fake_mode)
        if vsrc is not Y:
            raise Unsupported("the values are not an up-projection by the keys' weight")
        o_v = _check_rows(fv, [0, 1, 2, 3], roles, C, E, "values")
    if not (0 <= o_k and o_k + Dn <= E and 0 <= o_v and o_v + Dv <= E):
        raise Unsupported("a head's key or value columns leave its E columns")
    return Latent(rows=lat, weight=W, H=H, E=E, o_k=o_k, Dn=Dn, o_v=o_v, Dv=Dv, nope=(s, e), rot=rot[:2],
                  rot_node=rot[2], rot_dims=kmap, R=R, Dr=rot[1] - rot[0], scale=scale)


def latent_is_cheaper(lt: Latent, k: fx.Node, v: Optional[fx.Node]) -> Tuple[bool, str]:
    """The static rule (module docstring): bytes read per query and selected key (the keys
    only with ``v=None``)."""
    isz = lambda n: val(n).dtype.itemsize  # noqa: E731
    Dqk = lt.nope[1] - lt.nope[0] + lt.Dr
    per_head = lt.H * (Dqk * isz(k) + (lt.Dv * isz(v) if v is not None else 0))
    latent = lt.R * isz(lt.rows) + lt.Dr * isz(lt.rot_node)
    why = f"latent {latent} B against per head {per_head} B per selected key"
    return latent < per_head, why


# ------------------------------------------------------------------------------------------
# The rewrite
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Absorbed:
    q: fx.Node  # [B, S, H, R + Dr]
    k: fx.Node  # [B, T, 1, R + Dr]
    v: fx.Node  # [B, T, 1, R], a view of k
    latent: Latent
    B: Any
    S: Any
    why: str
    # the forward's pieces the absorbed backward reads
    q_canon: fx.Node  # the per-head form's canonical q [B, S, H, Dqk]
    q_heads: fx.Node  # q_pass per head [H, B*S, Dn]
    w_k: fx.Node  # [H, Dn, R]
    w_v: Optional[fx.Node]  # [H, R, Dv]; None for the keys only (``absorb(v=None)``)
    lat: fx.Node  # [B, T, R], a view of the latent rows
    rot: fx.Node  # [B, T, Dr]
    rot_src: Optional[fx.Node]  # the per-token tensor the expand over heads reads (rot views it)
    out_lat: Optional[fx.Node] = None  # the op's output [B, S, H, R]
    out_heads: Optional[fx.Node] = None  # it per head [H, B*S, R]

    def record(self) -> dict:
        lt = self.latent
        out = {"Hk": 1, "R": lt.R, "Dr": lt.Dr, "rule": self.why}
        if lt.scale != 1.0:
            out["key_scale"] = lt.scale  # folded into the query
        return out

    def output(self, em, out_lat: fx.Node) -> fx.Node:
        """The op's output over the latent [B, S, H, R] -> the attention's [B, S, H, Dv]."""
        lt = self.latent
        if self.w_v is None:
            raise Unsupported("absorbed without values (v=None): the op's output over the latent has no value "
                              "projection")
        x, w = _common_dtype(em, out_lat, self.w_v)
        x = _per_head(em, x, lt.H, self.B, self.S)
        self.out_lat, self.out_heads = out_lat, x
        return _from_heads(em, em.call(aten.bmm.default, [x, w]), lt.H, self.B, self.S)


def _per_head(em, x, H, B, S):
    """[B, S, H, D] -> [H, B*S, D]."""
    return em.call(aten.reshape.default, [em.call(aten.permute.default, [x, [2, 0, 1, 3]]),
                                          [H, _mul(em, B, S), shape_of(x)[3]]])


def _from_heads(em, x, H, B, S):
    """[H, B*S, D] -> [B, S, H, D]."""
    return em.call(aten.permute.default, [em.call(aten.reshape.default, [x, [H, B, S, shape_of(x)[2]]]),
                                          [1, 2, 0, 3]])


def _mul(em, a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    return em.call(operator.mul, [a, b])


def _size(em, n: fx.Node, d: int):
    s = shape_of(n)[d]
    if isinstance(s, int) or s.node.is_constant():
        return int(s)
    return em.call(aten.sym_size.int, [n, d])


def _common_dtype(em, a: fx.Node, b: fx.Node):
    dt = torch.promote_types(val(a).dtype, val(b).dtype)
    cast = lambda x: x if val(x).dtype == dt else em.call(  # noqa: E731
        torch.ops.prims.convert_element_type.default, [x, dt])
    return cast(a), cast(b)


def _head_weight(em, lt: Latent, o: int, width: int, perm) -> fx.Node:
    """W^T [R, H*E] -> the per-head columns [o, o + width) of each head, permuted."""
    w = em.call(aten.reshape.default, [lt.weight, [lt.R, lt.H, lt.E]])
    if (o, width) != (0, lt.E):
        w = em.call(aten.slice.Tensor, [w, 2, o, o + width])
    return em.call(aten.permute.default, [w, perm])


def absorb(em, q: fx.Node, k: fx.Node, v: Optional[fx.Node], latent: Optional[Latent] = None) -> Absorbed:
    """The absorbed operands of the op (canonical q, k, v of the per-head form in), or
    Unsupported with the reason the attention runs per head. ``v=None``: an op whose output
    is not read (the indexer loss's target, its probabilities only): the keys alone must be
    up-projections of the latent, and the absorbed v is the latent view all the same.
    ``latent``: ``find_latent(k, v, ...)``'s result where the caller already has it."""
    if not _eq(shape_of(q)[2], shape_of(k)[2]):
        raise Unsupported("the query heads are grouped over fewer key heads")
    lt = latent if latent is not None else find_latent(k, v, em.fake_mode)
    cheaper, why = latent_is_cheaper(lt, k, v)
    if not cheaper:
        raise Unsupported(f"per head reads fewer bytes ({why})")
    if val(lt.rows).dtype != val(lt.rot_node).dtype:
        raise Unsupported("the latent and the per-token key part have different dtypes")
    B, S, T = _size(em, q, 0), _size(em, q, 1), _size(em, k, 1)
    H, R = lt.H, lt.R
    # the latent key [B, T, 1, R + Dr] = [latent | k_rot] and its value view
    lat = em.call(aten.reshape.default, [lt.rows, [B, T, R]])
    rot, rot_src = lt.rot_node, None
    order = [d for d in lt.rot_dims if d is not None]
    order += [d for d in range(len(shape_of(rot))) if d not in order]
    h = lt.rot_dims[2]
    x = rot.args[0] if rot.target is aten.expand.default else None
    if x is not None and h is not None and len(shape_of(x)) == len(shape_of(rot)) and _eq(shape_of(x)[h], 1) \
            and all(_eq(a, b) for d, (a, b) in enumerate(zip(shape_of(x), shape_of(rot))) if d != h):
        rot = rot_src = rot.args[0]  # the per-token tensor itself (its gradient is the backward's)
    if order != list(range(len(order))):
        rot = em.call(aten.permute.default, [rot, order])
    if rot_src is not None:
        rot = em.call(aten.reshape.default, [rot, [B, T, lt.Dr]])
    else:
        rot = em.call(aten.reshape.default, [rot, [B, T, _size(em, k, 2), lt.Dr]])
        rot = em.call(aten.select.int, [rot, 2, 0])
    kl = em.call(aten.unsqueeze.default, [em.call(aten.cat.default, [[lat, rot], -1]), 2])
    vl = em.call(aten.slice.Tensor, [kl, 3, 0, R])
    # the absorbed query [B, S, H, R + Dr] = [q_pass W_kb | q_rot], times the keys' factor
    # (applied where the original applies it, before the matmul in the operand's dtype: one
    # rounding of each scaled query element in place of one of each scaled key element)
    qs = q if lt.scale == 1.0 else em.call(aten.mul.Tensor, [q, lt.scale])
    qp = em.call(aten.slice.Tensor, [qs, 3, lt.nope[0], lt.nope[1]])
    qr = em.call(aten.slice.Tensor, [qs, 3, lt.rot[0], lt.rot[1]])
    wk = _head_weight(em, lt, lt.o_k, lt.Dn, [1, 2, 0])  # [H, Dn, R]
    wv = _head_weight(em, lt, lt.o_v, lt.Dv, [1, 0, 2]) if v is not None else None  # [H, R, Dv]
    qp, wk = _common_dtype(em, qp, wk)
    qh = _per_head(em, qp, H, B, S)
    bmm = em.call(aten.bmm.default, [qh, wk])
    qa = _from_heads(em, bmm, H, B, S)
    qa, qr = _common_dtype(em, qa, qr)
    qa, kl = _common_dtype(em, qa, kl)
    if val(kl).dtype != val(vl).dtype:
        vl = em.call(aten.slice.Tensor, [kl, 3, 0, R])
    qc = em.call(aten.cat.default, [[qa, qr], -1])
    # The absorbed query [B, S, H, R + Dr] is the op's widest operand (576 per head against
    # q's 192 at DeepSeek's shape): the backward recomputes it (one bmm and a copy, the same
    # bits) from q_pass per head, which dW_kb's gradient saves anyway, and q_rot, rather
    # than keeping it from the forward.
    chain, stack = set(), [qc]
    while stack:
        n = stack.pop()
        if n not in chain and n in em.created:
            chain.add(n)
            if n is not bmm:
                stack.extend(a for a in n.all_input_nodes if a is not qr)
    for n in chain:
        tag_recompute(n)
    return Absorbed(q=qc, k=kl, v=vl, latent=lt, B=B, S=S, why=why, q_canon=q, q_heads=qh, w_k=wk, w_v=wv,
                    lat=lat, rot=rot, rot_src=rot_src)


# ------------------------------------------------------------------------------------------
# Training: the absorbed form's backward
# ------------------------------------------------------------------------------------------


def _region(graph: fx.Graph, pv: fx.Node, sources: dict):
    """(gradient in, {role: the gradient of that source}, region) for the backward of the
    attention and the per-head K/V expansion with its up-projection (the forward nodes
    between ``sources`` and the value contraction ``pv``). The gradient in is the one the
    backward of ``pv`` reads: shaped like ``pv``, or, where ``pv`` is a lowered fused sdpa's
    math (``passes/sdpa.py``), like the view of it that stands for the fused node's output,
    whose backward node reads that gradient; each source's gradient is the node of the
    backward of its reader (by ``seq_nr``) shaped like it (an output of a fused sdpa's
    backward: the one at the source's position, ``sdpa.gradient_operand``); the region is
    every backward node between them (the expansion's in-place writes have backward nodes
    whose ``seq_nr`` no functional forward node carries, so the region is found by the
    gradient's flow). Unsupported where another gradient enters the region or a node of it
    is read outside."""
    from . import sdpa
    from .attention import _through_views
    from .canonicalize import is_backward_node
    from .sparse_backward import _same_shape, _site_nodes, same_value

    site = _site_nodes(pv, set(sources.values())) - {u for u in pv.users if u.target is operator.getitem}
    bw = [n for n in graph.nodes if is_backward_node(n)]
    sn = pv.meta.get("seq_nr")
    pv_bw = [n for n in bw if sn is not None and n.meta.get("seq_nr") == sn]
    if not pv_bw:
        return None, {}, set()
    g_ins = {a for n in pv_bw for a in n.all_input_nodes if is_backward_node(a) and a.meta.get("seq_nr") != sn}
    g_in = g_ins.pop() if len(g_ins) == 1 else None
    fused_out = g_in is not None and any(n.target in sdpa.BACKWARD and n.args[0] is g_in for n in pv_bw)
    if g_in is None or not (_same_shape(g_in, pv) or (fused_out and _through_views(pv, g_in) is not None)):
        raise Unsupported("the backward of the value contraction does not read one gradient shaped like its output")
    desc, stack = set(), [g_in]
    while stack:
        for u in stack.pop().users:
            # (a node a pass wrote without autograd's tags, e.g. a dynamic scale's product, is
            # the backward's too: no forward node reads a gradient)
            if u not in desc and (is_backward_node(u) or (u.op == "call_function" and "seq_nr" not in u.meta
                                                          and "partitioner_tag" not in u.meta)):
                desc.add(u)
                stack.append(u)
    outs = {}
    for role, x in sources.items():
        xs = same_value(x, site)
        seqs = {f.meta.get("seq_nr") for f in site if f not in xs and xs & set(f.all_input_nodes)} - {None}
        cands = [e for e in desc if e.meta.get("seq_nr") in seqs and _same_shape(e, x)
                 and any(u.meta.get("seq_nr") not in seqs for u in e.users)
                 and sdpa.gradient_operand(e) in (None, *xs)]  # (q and k may have one shape)
        if len(cands) > 1:
            raise Unsupported(f"cannot tell which node of the backward is the gradient of {role} ({x.name})")
        if cands:
            outs[role] = cands[0]
    region, stack = set(), list(outs.values())
    while stack:
        n = stack.pop()
        if n in region or n not in desc:
            continue
        region.add(n)
        stack.extend(n.all_input_nodes)
    tangent = set()
    for n in graph.nodes:
        if (n.op == "placeholder" and n.name.startswith("tangents")) or any(a in tangent for a in n.all_input_nodes):
            tangent.add(n)
    ends = set(outs.values())
    for n in region:
        for a in n.all_input_nodes:
            if a in tangent and a not in region and a is not g_in:
                raise Unsupported(f"another gradient ({a.name}) enters the backward of the attention and its K/V "
                                  "expansion")
        if n not in ends and any(u not in region for u in n.users):
            raise Unsupported(f"{n.name} of the backward of the attention and its K/V expansion is read outside it")
    return g_in, outs, region


def rewrite_backward(graph: fx.Graph, m, applied) -> str:
    """The backward of the attention and of the per-head K/V expansion (the nodes sharing
    ``seq_nr`` with them) becomes the absorbed form's: dOut -> d out_lat (bmm with W_vb) and
    dW_vb; ``sparse_attention_backward`` -> d q_cat, d latent (its key part plus its value
    view); d q_pass (bmm with W_kb^T) and dW_kb; d k_rot once per token (what the original's
    expand backward sums). Returns "sparse", or "" when no gradient reaches it; Unsupported
    (with the reason) where the region is not of that shape: the caller then runs the
    attention per head."""
    from ..lowerings import attention_ops  # noqa: F401
    from . import sdpa
    from .attention import emit_delta
    from .rewrite import Emitter
    from .sparse_backward import KeepDense, _invert_views, _same_shape

    ab: Absorbed = applied.absorbed
    pv, spec = m.region.pv, m.spec.to_json()
    lt = ab.latent
    if ab.rot_src is None:
        raise Unsupported("the per-token key part is not an expand over the heads of one tensor")
    (lo, hi) = sorted([(lt.o_k, lt.o_k + lt.Dn, "k"), (lt.o_v, lt.o_v + lt.Dv, "v")])
    if lo[1] > hi[0]:
        raise Unsupported("a head's key and value columns of the up-projection overlap")
    sources = {"q": m.q.node, "rows": lt.rows, "w": lt.weight, "rot": ab.rot_src}
    g_in, found, rset = _region(graph, pv, sources)
    if g_in is None or not found:
        return ""
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = max((g_in, applied.replaced, applied.out, applied.lse), key=lambda n: order[n])
    em = Emitter(graph, last.next)
    H, B, S, R = lt.H, ab.B, ab.S, lt.R
    conv = torch.ops.prims.convert_element_type.default

    def cast(x, like):
        dt = val(like).dtype
        return x if val(x).dtype == dt else em.call(conv, [x, dt])

    try:
        g = g_in
        if not _same_shape(g_in, pv):  # the gradient of a lowered fused sdpa's output, a row-major view of pv
            g = em.call(aten.reshape.default, [g, list(val(pv).shape)])
        g = _invert_views(em, g, applied.replaced, applied.out)
        # out = per head out_lat @ W_vb
        gh, wv = _common_dtype(em, _per_head(em, g, H, B, S), ab.w_v)
        d_ol = em.call(aten.bmm.default, [gh, em.call(aten.permute.default, [wv, [0, 2, 1]])])
        oh, gh2 = _common_dtype(em, ab.out_heads, gh)
        d_wv = em.call(aten.bmm.default, [em.call(aten.permute.default, [oh, [0, 2, 1]]), gh2])  # [H, R, Dv]
        d_ol = cast(_from_heads(em, d_ol, H, B, S), ab.out_lat)
        # (after d_wv, the output's other reader: it is freed before the op's buffers exist)
        delta = emit_delta(em, d_ol, ab.out_lat, applied.lse)
        call = em.call(torch.ops.hyscale.sparse_attention_backward.default,
                       [d_ol, ab.q, ab.k, ab.v, applied.idx, applied.masks, delta, applied.lse, spec,
                        True, True, True])
        gq, gk, gv = (em.call(operator.getitem, [call, i]) for i in range(3))
        # the latent is the key and (a view of it) the value
        d_lat = em.call(aten.add.Tensor, [em.call(aten.slice.Tensor, [gk, 3, 0, R]), gv])
        d_lat = em.call(aten.squeeze.dim, [d_lat, 2])
        d_rot = em.call(aten.squeeze.dim, [em.call(aten.slice.Tensor, [gk, 3, R, R + lt.Dr]), 2])
        # q_abs = per head q_pass @ W_kb
        gqa = _per_head(em, em.call(aten.slice.Tensor, [gq, 3, 0, R]), H, B, S)
        gqa, wk = _common_dtype(em, gqa, ab.w_k)
        d_qp = _from_heads(em, em.call(aten.bmm.default, [gqa, em.call(aten.permute.default, [wk, [0, 2, 1]])]), H, B, S)
        qh, gqa2 = _common_dtype(em, ab.q_heads, gqa)
        d_wk = em.call(aten.bmm.default, [em.call(aten.permute.default, [qh, [0, 2, 1]]), gqa2])  # [H, Dn, R]
        # (the gradients of the scaled query: the keys' factor, if any, once more)
        sc = lambda x: x if lt.scale == 1.0 else em.call(aten.mul.Tensor, [x, lt.scale])  # noqa: E731
        parts = sorted([(lt.nope[0], cast(sc(d_qp), ab.q_canon)),
                        (lt.rot[0], cast(sc(em.call(aten.slice.Tensor, [gq, 3, R, R + lt.Dr])), ab.q_canon))],
                       key=lambda p: p[0])
        d_q = em.call(aten.cat.default, [[p for _, p in parts], -1])
        # W^T [R, H*E]: each head's key and value columns, zero elsewhere
        cols = {"k": em.call(aten.permute.default, [d_wk, [2, 0, 1]]),
                "v": em.call(aten.permute.default, [d_wv, [1, 0, 2]])}
        pieces, at = [], 0
        for a, b, name in (lo, hi):
            if a > at:
                pieces.append(em.call(aten.full.default, [[R, H, a - at], 0.0],
                                      {"dtype": val(lt.weight).dtype, "device": val(lt.weight).device}))
            pieces.append(cast(cols[name], lt.weight))
            at = b
        if at < lt.E:
            pieces.append(em.call(aten.full.default, [[R, H, lt.E - at], 0.0],
                                  {"dtype": val(lt.weight).dtype, "device": val(lt.weight).device}))
        d_w = em.call(aten.reshape.default, [em.call(aten.cat.default, [pieces, -1]), [R, H * lt.E]])
        d_q = _invert_views(em, d_q, ab.q_canon, sources["q"])
        if "q" in found and sdpa.gradient_operand(found["q"]) is not None:  # laid out as the fused backward's
            d_q = sdpa.like_strides(em, d_q, val(found["q"]))  # (the graph's views were traced on it)
        grads = {"q": d_q,
                 "rows": cast(_invert_views(em, d_lat, ab.lat, lt.rows), lt.rows),
                 "w": d_w,
                 "rot": cast(_invert_views(em, d_rot, ab.rot, ab.rot_src), ab.rot_src)}
    except KeepDense as e:
        em.rollback()
        raise Unsupported(str(e)) from None
    except Exception:
        em.rollback()
        raise
    for role, e in found.items():
        new = grads[role]
        if not _eq_shape(new, e):
            em.rollback()
            raise Unsupported(f"internal: the absorbed gradient of {role} is not shaped like the original's")
    for role, e in found.items():
        e.replace_all_uses_with(grads[role], delete_user_cb=lambda u: u not in rset)
    return "sparse"


def _eq_shape(a, b) -> bool:
    va, vb = val(a), val(b)
    return va.dim() == vb.dim() and va.dtype == vb.dtype and all(_eq(x, y) for x, y in zip(va.shape, vb.shape))

