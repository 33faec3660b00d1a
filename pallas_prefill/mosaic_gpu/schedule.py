"""The Mosaic GPU kernel's unit schedule: which program runs which (head, work item) unit,
in which order.

The persistent kernel's programs (one per SM) run units back to back. With dynamic
scheduling (``MosaicOptions.dynamic``, the default) each program's producer claims its
next unit from a global counter (``primitives.claim``), one unit ahead, so that programs
balance whatever the units' real costs; where the static zigzag balances better, the
programs take the units it deals them (``dynamic_schedule``). The units come in
K/V-head-major order (``unit_head_item``: the units running together share a K/V head's
rows in L2, heaviest items first within it) or item-major, picked per call by a cost
model (``item_costs``) that XLA and ``work_items``' kernel share. Without dynamic
scheduling, the static deal (``program_unit``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_prefill.config import MosaicConfig

# ``head_major_order``: a unit costs its KV tiles plus about one tile of its own (the Q
# load, the pipeline's fill and the stores), and the K/V-head-major order is taken when
# its busiest program has at most this much more work than the item-major order's.
UNIT_COST_TILES = 1
HEAD_MAJOR_SLACK = 1.05  # as 21/20 (``head_major_wins``)
H200_SMS = 132  # the persistent grid's size when no GPU is attached (abstract lowering)


def dealt_unit(program, num_programs, k):
  """The unit u that program `program` runs k-th: units are dealt out row by row,
  num_programs to a row, in a zigzag (program p takes unit p of even rows and unit
  num_programs - 1 - p of odd ones)."""
  return k * num_programs + jnp.where(lax.rem(k, 2) == 0, program, num_programs - 1 - program)


def program_unit(program, num_programs, k, *, num_heads, group, n_live, head_major):
  """The (head, item) of program `program`'s k-th unit of work.

  The units, (head, item) pairs over the ``n_live`` items that run, are dealt out in a
  zigzag (``dealt_unit``) in one of two orders, ``head_major`` (a traced flag,
  ``head_major_order``) picking:

  - item-major, u = item * num_heads + head: an item's heads side by side, so that the
    heads of a K/V group share its rows in L2. Items come heaviest first, so each
    program's pairs of rows add up to about the same work (simulated with ``work_list``'s
    tiles on the harness's workloads: the busiest program 1.00 to 1.02x the mean; plain
    round robin 1.03 to 1.06x).
  - K/V-head-major, u = (kv_head * n_live + item) * group + head of group: the programs
    running together work on many items of a few K/V heads and share their sequences' K/V
    rows in L2, which MLA (a K/V head per query head) needs (+10 % on equal4x4096). Its
    balance depends on how n_live * group falls on the rows, hence the choice per call.
  """
  return unit_head_item(dealt_unit(program, num_programs, k), num_heads=num_heads,
                        group=group, n_live=n_live, head_major=head_major)


def unit_head_item(unit, *, num_heads, group, n_live, head_major):
  """The (head, item) of unit `unit` in the order ``head_major`` picks (``program_unit``)."""
  heads = jnp.int32(num_heads)
  per_kv_head = jnp.maximum(n_live * group, 1)
  rest = lax.rem(unit, per_kv_head)
  by_kv_head = (lax.div(unit, per_kv_head) * group + lax.rem(rest, jnp.int32(group)),
                lax.div(rest, jnp.int32(group)))
  by_item = (lax.rem(unit, heads), lax.div(unit, heads))
  return tuple(jnp.where(head_major != 0, a, b) for a, b in zip(by_kv_head, by_item))


ALL_HEADS = -1  # ``unit_of``'s head for a key-less item's one unit


def unit_of(unit, *, num_heads, group, n_keyed, n_keyless, head_major, spread=False):
  """The (head, item) of unit `unit` when the live items' last ``n_keyless`` have no KV
  tile (``MosaicOptions.keyless_units``): those items are one unit each for all their
  heads (head ``ALL_HEADS``: they only store zeros), the others the (head, item) units
  of the ``n_keyed`` items with tiles in ``unit_head_item``'s order. The key-less units
  come first (units [0, n_keyless)), or with ``spread`` one after every s keyed units,
  s = n_keyed * num_heads // n_keyless, so that their stores overlap the other
  programs' matrix products. ``n_keyless`` None: no key-less units of their own
  (``unit_head_item`` over ``n_keyed`` items)."""
  order = dict(num_heads=num_heads, group=group, n_live=n_keyed, head_major=head_major)
  if n_keyless is None:
    return unit_head_item(unit, **order)
  if spread:
    # Blocks of `stride` units, the last of each of the first n_keyless blocks key-less.
    stride = lax.div(n_keyed * num_heads, jnp.maximum(n_keyless, 1)) + 1
    block = lax.div(unit, stride)
    keyless = (lax.rem(unit, stride) == stride - 1) & (block < n_keyless)
    j, keyed = block, unit - jnp.minimum(block, n_keyless)
  else:
    keyless = unit < n_keyless
    j, keyed = unit, unit - n_keyless
  head, item = unit_head_item(keyed, **order)
  return jnp.where(keyless, ALL_HEADS, head), jnp.where(keyless, n_keyed + j, item)


def zero_jobs(unit, *, num_heads, n_keyed, n_keyless):
  """``MosaicOptions.keyless_units="stores"``: keyed unit `unit`'s zero jobs, as (count,
  stride): jobs unit, unit + stride, ... (count of them) of the n_keyless * num_heads
  jobs, one per (head, key-less item) (``zero_job``), so that every job falls to exactly
  one of the n_keyed * num_heads keyed units whatever order they run in. No keyed unit:
  no job (the key-less items then run as units, ``stores_keyless_units``)."""
  keyed_units = n_keyed * num_heads
  jobs = jnp.where(keyed_units > 0, n_keyless * num_heads, 0)
  stride = jnp.maximum(keyed_units, 1)
  return lax.div(jnp.maximum(jobs - unit, 0) + stride - 1, stride), stride


def zero_job(job, *, num_heads, n_keyed):
  """The (head, item) of zero job `job` (``zero_jobs``): head job % num_heads of key-less
  item n_keyed + job // num_heads (the key-less items follow the keyed ones in the work
  list)."""
  heads = jnp.int32(num_heads)
  return lax.rem(job, heads), n_keyed + lax.div(job, heads)


def stores_keyless_units(n_keyed, n_keyless):
  """``keyless_units="stores"``: the key-less items that still run as units of their own
  (``unit_of``, first), all of them when no item has a KV tile (no keyed unit to take
  their zero jobs), else none."""
  return jnp.where(n_keyed > 0, 0, n_keyless)


def num_units(num_heads, n_keyed, n_keyless):
  """The units of ``unit_of``: a unit per head of each keyed item, plus one per key-less
  item (``n_keyless`` None: none)."""
  return n_keyed * num_heads + (0 if n_keyless is None else n_keyless)


def program_loads(unit_costs, num_programs):
  """Each program's summed cost of the units (in order u = 0, 1, ...) it is dealt."""
  rows = -(-unit_costs.shape[0] // num_programs)
  costs = jnp.pad(unit_costs, (0, rows * num_programs - unit_costs.shape[0]))
  costs = costs.reshape(rows, num_programs)
  odd = (jnp.arange(rows) % 2 == 1)[:, None]
  return jnp.where(odd, costs[:, ::-1], costs).sum(axis=0)


def item_costs(item_tiles, live):
  """Each item's cost in tiles for the unit orders' estimates: its KV tiles plus
  ``UNIT_COST_TILES``, 0 where ``live`` is False (the items past n_live do not run);
  int32. XLA's estimates and ``work_items``' kernel (a lane per item) share it."""
  return jnp.where(live, item_tiles + UNIT_COST_TILES, 0).astype(jnp.int32)


def head_major_order(item_tiles, n_live, *, num_heads, group, num_programs):
  """Whether the units run K/V-head-major (``program_unit``): 1 when that order's busiest
  program, by the items' KV tiles, has at most ``HEAD_MAJOR_SLACK`` times the work of the
  item-major order's busiest program, else 0 (an int32 scalar, computed in XLA).

  item_tiles: [num_items] KV tiles of each item in table order (items past n_live do not
  run)."""
  items = item_tiles.shape[0]
  cost = item_costs(item_tiles, jnp.arange(items) < n_live)
  by_item = jnp.repeat(cost, num_heads)
  u = jnp.arange(num_heads * items, dtype=jnp.int32)
  rest = u % jnp.maximum(n_live * group, 1)
  by_kv_head = jnp.where(u < n_live * num_heads, cost[rest // group], 0)
  worst = lambda c: program_loads(c, num_programs).max()  # noqa: E731
  return head_major_wins(worst(by_kv_head), worst(by_item)).astype(jnp.int32)


def dynamic_head_major_order(item_tiles, n_live, *, num_heads, group, num_programs):
  """With dynamic scheduling, whether the units run K/V-head-major: 1 when that order's
  estimated end, by the items' KV tiles, is at most ``HEAD_MAJOR_SLACK`` times the
  item-major order's, else 0 (an int32 scalar, computed in XLA; ``work_items`` computes
  the same in its kernel).

  The programs take units in order as they free up, so a unit starts about when the
  units before it, spread over the programs, are done, and the call ends when the latest
  ``start + cost`` does (``claimed_order_end``). Items come heaviest first, so
  item-major ends within about one light unit of the average; K/V-head-major starts the
  last K/V head's heavy items only after the other heads' work, which costs a heavy
  unit's time at the end where the units of one K/V head are few against the programs
  (MHA's chunked prefill: 415 useful TFLOP/s against 497 item-major on the H200).

  item_tiles: [num_items] KV tiles of each item in table order (items past n_live do not
  run)."""
  cost = item_costs(item_tiles, jnp.arange(item_tiles.shape[0]) < n_live)
  ends = claimed_order_end(cost, jnp.cumsum(cost) - cost, num_heads=num_heads,
                           group=group, num_programs=num_programs)
  return head_major_wins(*ends).astype(jnp.int32)


def dynamic_schedule(item_tiles, n_live, *, num_heads, group, num_programs):
  """With dynamic scheduling, the units' order and how the programs take them: (head
  major, deal), int32 scalars (XLA; ``work_items`` computes the same in its kernel).

  - Claimed K/V-head-major (1, 0) where claiming in that order ends in time
    (``dynamic_head_major_order``).
  - Else, where the static zigzag balances the K/V-head-major order
    (``head_major_order``), dealt K/V-head-major (1, 1). The programs then take the units
    ``dealt_unit`` deals them, with no claim. On MLA's chunked prefill (a K/V head per
    query head) this ran 493 useful TFLOP/s on the H200 against 455 claimed item-major
    (which read K/V from DRAM at 71 % of its bandwidth, L2 hits 14 %; the static
    kernel's deal had 68 %), and claimed K/V-head-major ran 450 (BUILD_NOTES.md).
  - Else claimed item-major (0, 0): MHA's chunked prefill."""
  kw = dict(num_heads=num_heads, group=group, num_programs=num_programs)
  return schedule_of(dynamic_head_major_order(item_tiles, n_live, **kw),
                     head_major_order(item_tiles, n_live, **kw))


def schedule_of(claimed, dealt):
  """``dynamic_schedule``'s (head major, deal) from its two verdicts, int32 scalars 0 or
  1: whether claimed K/V-head-major ends in time (``dynamic_head_major_order``) and
  whether the static zigzag balances K/V-head-major (``head_major_order``). XLA and
  ``work_items``' kernel share it."""
  return jnp.maximum(claimed, dealt), (1 - claimed) * dealt


def claimed_order_end(cost, before, *, num_heads, group, num_programs):
  """The estimated ends (in tiles: K/V-head-major, item-major) of units claimed in order
  by ``num_programs`` programs: the largest over the items of (the work claimed before
  the item's last unit) / num_programs + the item's cost. ``cost``: each item's cost
  (0 past the live items), ``before``: the exclusive prefix sum of ``cost`` (its caller's
  scan: XLA's or ``work_items``' kernel's). int32, the same arithmetic in both: each term
  divided on its own, so that num_heads * (the total cost) stays the largest product; one
  past 2^31 would pick the order wrongly, never the results."""
  p = jnp.int32(num_programs)
  live = cost > 0
  total = jnp.sum(cost)
  # Item-major: the item's num_heads units follow the earlier items' units.
  by_item = lax.div(num_heads * before + (num_heads - 1) * cost, p) + cost
  # K/V-head-major: the last K/V head's units of the item follow all other heads' units
  # and the earlier items' units of that head (its first heads' as well).
  by_kv_head = (lax.div((num_heads - group) * total, p)
                + lax.div(group * before + (group - 1) * cost, p) + cost)
  return (jnp.max(jnp.where(live, by_kv_head, 0)), jnp.max(jnp.where(live, by_item, 0)))


def head_major_wins(worst_kv_head, worst_item):
  """Whether the K/V-head-major order's busiest program, of ``worst_kv_head`` tiles, has
  at most ``HEAD_MAJOR_SLACK`` (21/20) times the item-major order's ``worst_item``
  (int32 scalars: exact in integers, the same in XLA and in ``work_items``)."""
  return 20 * worst_kv_head <= 21 * worst_item


def num_local_units(program, num_programs, num_units):
  """How many of the units [0, num_units) program `program` of `num_programs` runs: one
  per full row, and one of the last row if its zigzag position is there."""
  rows, rest = lax.div(num_units, num_programs), lax.rem(num_units, num_programs)
  pos = jnp.where(lax.rem(rows, 2) == 0, program, num_programs - 1 - program)
  return rows + (pos < rest).astype(rows.dtype)


def num_programs(num_units_bound: int, config: MosaicConfig) -> int:
  """The persistent grid: ``config.num_programs``, else one program per SM of the first
  GPU (an H200's 132 when JAX sees none, as when lowering for an abstract H200); no more
  than there are units."""
  programs = config.num_programs
  if programs is None:
    try:
      programs = jax.devices("gpu")[0].core_count
    except RuntimeError:
      programs = H200_SMS
  return max(1, min(programs, num_units_bound))


