"""Head parallelism inside JAX's SPMD partitioner.

Attention heads are independent, so a kernel call over head-sharded operands is the same
kernel on each device's heads. ``head_parallel`` wraps an entry point's implementation in
``jax.experimental.custom_partitioning``: under ``jax.jit`` with operands sharded along the
head axis (a ``NamedSharding``), each device runs the kernel on its own heads and the
compiled program moves no Q, K, V or output between devices. Any other sharding (tokens,
replicated, heads that do not divide evenly) is gathered and computed whole on every
device: correct, not parallel. On one device the implementation is called directly, and
inside ``shard_map`` (where each device already holds its shard) it is inlined unchanged.
Under ``jax.vmap`` (custom_partitioning has no batching rule) it is called directly too:
an entry point vmapped as it is (``batched``), not a ``jax.jit`` of it.

Operands whose types carry a sharding over a mesh with Explicit axes (``jax.make_mesh``'s
default) cannot go through custom_partitioning (a Pallas kernel's refs refuse sharded
types): they are resharded to the head split and run per device in ``jax.shard_map``
(``_on_explicit_mesh``), which gives the same result and the same placement.

Where the program spans several devices (a mesh of more than one device around the call,
as inside ``shard_map``, or a partition over several), ``backend="auto"`` is pinned to the
Triton kernel (``several_devices``): the Mosaic GPU kernel has not run on more than one GPU
yet (issue 26). "mosaic_gpu" and a ``MosaicConfig`` are kept.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from pallas_prefill.config import MosaicConfig
from pallas_prefill.paged import PagedKV


@dataclasses.dataclass(frozen=True)
class Heads:
  """Where an operand's head axis is: ``axis`` (negative) counts query heads (``kv=False``)
  or K/V heads (``kv=True``). An operand with one head where there are several K/V heads
  (MLA's shared rope key) has nothing to split and is replicated."""

  axis: int
  kv: bool = False


Q_HEADS = Heads(-2)  # q [total_q, num_heads, depth], out, and paged/packed K/V alike
KV_HEADS = Heads(-2, kv=True)
SINK_HEADS = Heads(-1)  # sink_weights [num_heads], lse [total_q, num_heads]
SCALE_HEADS = Heads(-1, kv=True)  # FP8 scales [batch, num_kv_heads], a tuple of them


def _leaf_roles(operands, roles):
  """The role of each pytree leaf: a PagedKV's pages take its role, its block table and
  cache lengths are replicated; a tuple's arrays each take the tuple's role; None
  operands have no leaves."""
  out = []
  for x, role in zip(operands, roles):
    if x is None:
      continue
    if isinstance(x, PagedKV):
      out += [role, None, None]
    elif isinstance(x, tuple):
      out += [role] * len(x)
    else:
      out += [role]
  return tuple(out)


def head_parallel(fn, operands, roles, out_roles, *, num_heads, num_kv_heads, **static):
  """``fn(*operands, **static)``, partitioned along heads by JAX's SPMD partitioner.

  Args:
    fn: the implementation; returns an array or a tuple of arrays.
    operands: its positional operands (arrays, PagedKV or None).
    roles: per operand, a ``Heads`` or None (replicated: offsets and the like).
    out_roles: per output, a ``Heads``.
    num_heads, num_kv_heads: the query and K/V head counts.
    **static: hashable keyword arguments of fn.
  """
  leaves, treedef = jax.tree.flatten(operands)
  leaf_roles = _leaf_roles(operands, roles)
  explicit = _explicit_mesh(leaves)
  if explicit is not None:
    return _on_explicit_mesh(fn, treedef, leaves, leaf_roles, out_roles, explicit,
                             num_heads=num_heads, num_kv_heads=num_kv_heads, static=static)
  if not _may_partition() or batched(leaves):
    return fn(*operands, **static)
  if _abstract_devices() > 1:  # shard_map's per-device programs, an abstract mesh
    static = several_devices(static)
  wrapped = _partitioned(fn, treedef, leaf_roles, tuple(out_roles), num_heads, num_kv_heads,
                         tuple(sorted(static.items())),
                         tuple((x.ndim, x.shape[r.axis] if r else 0)
                               for x, r in zip(leaves, leaf_roles)))
  return wrapped(*leaves)


def output_struct(inputs, shape, dtype) -> jax.ShapeDtypeStruct:
  """A kernel output's type: inside ``shard_map`` it varies over the mesh axes that any of
  the kernel's ``inputs`` varies over (a ``pallas_call``'s out_shape must say so)."""
  varying = frozenset().union(*(jax.typeof(x).mat.varying for x in inputs))
  return jax.ShapeDtypeStruct(shape, dtype,
                              manual_axis_type=jax.sharding.ManualAxisType(varying=varying))


def batched(*operands) -> bool:
  """Whether ``jax.vmap`` is batching any of the operands (their leaves are its tracers,
  which carry a ``batch_dim``). custom_partitioning has no batching rule, so such a call
  runs unpartitioned, and the entry points call their implementation outside their own
  ``jax.jit`` (whose batching rule would batch a traced custom_partitioning)."""
  return any(getattr(x, "batch_dim", None) is not None for x in jax.tree.leaves(operands))


def traced(*operands) -> bool:
  """Whether any operand is a value of a program being traced (``jax.jit``,
  ``jax.eval_shape``), seen through ``jax.vmap``'s tracers to the values they batch: an
  eager vmap's are concrete."""
  for x in jax.tree.leaves(operands):
    while hasattr(x, "batch_dim") and hasattr(x, "val"):  # a BatchTracer
      x = x.val
    if isinstance(x, jax.core.Tracer):
      return True
  return False


def implementation(jitted, *operands):
  """An entry point's jitted implementation for these operands: under ``jax.vmap``
  (``batched``) the function it wraps, so that the batched call runs unpartitioned;
  traced with ``jax_enable_x64`` off (the kernels' index arithmetic is int32, and
  Pallas' own indexing mixes in int64 under x64)."""
  fn = jitted.__wrapped__ if batched(*operands) else jitted

  @functools.wraps(fn)
  def in_32_bits(*args, **kwargs):
    with jax.enable_x64(False):
      return fn(*args, **kwargs)

  return in_32_bits


def _may_partition() -> bool:
  """Whether the program being traced can span several devices. A single-device program
  (and ahead-of-time lowering for one abstract device, where custom_partitioning cannot
  lower) calls the implementation directly."""
  mesh = jax.sharding.get_abstract_mesh()
  return mesh.size > 1 if not mesh.empty else jax.device_count() > 1


def _abstract_devices() -> int:
  """The devices of the abstract mesh around the call (0: none)."""
  mesh = jax.sharding.get_abstract_mesh()
  return 0 if mesh.empty else mesh.size


def several_devices(static: dict) -> dict:
  """The entry point's static options for a program over several devices: "auto" runs
  the Triton kernel (the Mosaic GPU kernel has not run on more than one GPU yet, issue
  26); an explicit backend, and "auto" with a ``MosaicConfig`` (which picks Mosaic GPU),
  are kept."""
  if static.get("backend") == "auto" and not isinstance(static.get("config"), MosaicConfig):
    return dict(static, backend="triton")
  return static


def _explicit_mesh(leaves):
  """The mesh of the first operand whose type carries a sharding over Explicit mesh axes
  of more than one device, or None."""
  for x in leaves:
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if (mesh is not None and not mesh.empty and mesh.size > 1
        and AxisType.Explicit in tuple(mesh.axis_types)):
      return mesh
  return None


def _split_axes(mesh, spec, num_heads, num_kv_heads):
  """The mesh axes a spec splits q's heads over, where the kernel can run on those shards
  (the heads and K/V heads divide among them, or one K/V head); else None."""
  axes = spec[1] if len(spec) > 1 else None
  if axes is None:
    return None
  axes = axes if isinstance(axes, tuple) else (axes,)
  n = math.prod(mesh.shape[a] for a in axes)
  splittable = num_kv_heads % n == 0 or num_kv_heads == 1
  return axes if n > 1 and num_heads % n == 0 and splittable else None


def _head_spec(axes, role, ndim, heads, num_kv_heads):
  """An operand's (or output's) spec: its head axis over ``axes`` where its role splits
  (K/V heads only when there are several, one per query-head group), the rest whole."""
  spec = [None] * ndim
  kv_split = heads == num_kv_heads and num_kv_heads > 1
  if role is not None and axes is not None and (not role.kv or kv_split):
    spec[ndim + role.axis] = axes
  return P(*spec)


def _on_explicit_mesh(fn, treedef, leaves, leaf_roles, out_roles, mesh, *, num_heads,
                      num_kv_heads, static):
  """``fn`` per device in ``jax.shard_map`` over an Explicit-axes mesh: the operands
  resharded to q's head split (``_split_axes``; whole on every device where it cannot
  split), the outputs split the same way; "auto" pinned (``several_devices``)."""
  axes = _split_axes(mesh, jax.typeof(leaves[0]).sharding.spec, num_heads, num_kv_heads)
  in_specs = tuple(_head_spec(axes, r, x.ndim, x.shape[r.axis] if r else 0, num_kv_heads)
                   for x, r in zip(leaves, leaf_roles))
  out_specs = tuple(_head_spec(axes, r, 3 if r == Q_HEADS else 2, num_heads, num_kv_heads)
                    for r in out_roles)
  pinned = several_devices(static)

  def per_device(*shards):
    return fn(*jax.tree.unflatten(treedef, shards), **pinned)

  leaves = [jax.sharding.reshard(x, NamedSharding(mesh, s)) for x, s in zip(leaves, in_specs)]
  # check_vma=False: Pallas' interpreter reads a ref that varies over the mesh (an FP8
  # scale split over heads) at an index that does not (a program id), and its
  # dynamic_slice refuses the mix; the specs above say where everything goes.
  return jax.shard_map(per_device, mesh=mesh, in_specs=in_specs,
                       out_specs=out_specs if len(out_specs) > 1 else out_specs[0],
                       check_vma=False)(*leaves)


def _head_factor(role, heads, num_kv_heads, group):
  """The sharding-rule factor of a head axis: K/V heads are factor k, query heads the
  compound (k g) whose major part k lines up with the K/V heads they attend to. With one
  K/V head (MQA) the query heads are g alone and K/V have nothing to split."""
  if role.kv:
    return "k" if heads == num_kv_heads > 1 else None
  if num_kv_heads == 1:
    return "g"
  return "k" if group == 1 else "(k g)"


@functools.lru_cache(maxsize=None)
def _partitioned(fn, treedef, roles, out_roles, num_heads, num_kv_heads, static, dims):
  static = dict(static)
  group = num_heads // num_kv_heads

  def impl(*leaves):
    return fn(*jax.tree.unflatten(treedef, leaves), **static)

  def impl_over_several(*leaves):
    return fn(*jax.tree.unflatten(treedef, leaves), **several_devices(static))

  def rule_operand(i, role, ndim, heads):
    factors = [f"r{i}_{d}" for d in range(ndim)]
    head = role and _head_factor(role, heads, num_kv_heads, group)
    if head:
      factors[ndim + role.axis] = head
    return " ".join(factors)

  in_rules = [rule_operand(i, r, ndim, h) for i, (r, (ndim, h)) in enumerate(zip(roles, dims))]
  out_ndims = [3 if r == Q_HEADS else 2 for r in out_roles]  # out, lse
  out_rules = [rule_operand(f"o{i}", r, n, num_heads)
               for i, (r, n) in enumerate(zip(out_roles, out_ndims))]
  replicated = tuple(f for rule in in_rules + out_rules for f in rule.split()
                     if f.startswith("r"))
  rule = ", ".join(in_rules) + " -> " + ", ".join(out_rules)
  sizes = {"g": group} if group > 1 and num_kv_heads > 1 else {}  # g only in (k g)

  def head_axes(mesh, arg_shapes):
    """The mesh axes q's heads are sharded over, if the kernel can run on those shards."""
    return _split_axes(mesh, arg_shapes[0].sharding.spec, num_heads, num_kv_heads)

  def sharding(mesh, axes, role, ndim, heads):
    return NamedSharding(mesh, _head_spec(axes, role, ndim, heads, num_kv_heads))

  def out_shardings(mesh, axes):
    shards = tuple(sharding(mesh, axes, r, n, num_heads) for r, n in zip(out_roles, out_ndims))
    return shards if len(shards) > 1 else shards[0]

  def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
    del result_shape
    return out_shardings(mesh, head_axes(mesh, arg_shapes))

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    axes = head_axes(mesh, arg_shapes)
    arg_shardings = tuple(sharding(mesh, axes, r, ndim, h)
                          for r, (ndim, h) in zip(roles, dims))
    run = impl if mesh.size == 1 else impl_over_several
    return mesh, run, out_shardings(mesh, axes), arg_shardings

  wrapped = custom_partitioning(impl)
  wrapped.def_partition(
      partition=partition, infer_sharding_from_operands=infer_sharding_from_operands,
      sharding_rule=rule, need_replication_factors=replicated, **sizes)
  return wrapped
