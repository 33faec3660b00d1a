"""What a lowered module holds: its custom calls, and its kernels' own modules (Triton IR,
Mosaic GPU MLIR) printed as text without locations. Shared by the lowering tests and
``scripts/lowered_ir.py``."""

from __future__ import annotations

import re

from jax._src.interpreters import mlir as jax_mlir  # pylint: disable=g-direct-tensorflow-import
from jax.extend.mlir import ir


def custom_calls(module) -> list:
  """The ``stablehlo.custom_call`` operations of a lowered module (``compiler_ir``), in
  program order, nested regions included."""
  found = []

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for child in block.operations:
          child = child.operation
          if child.name == "stablehlo.custom_call":
            found.append(child)
          walk(child)

  walk(module.operation)
  return found


def kernel_modules(module) -> list[tuple[str, bytes]]:
  """(kind, bytes) of each custom call's embedded kernel: kind "ir" (Triton) or "module"
  (Mosaic GPU), in program order."""
  found = []
  for call in custom_calls(module):
    if "mhlo.backend_config" not in call.attributes:
      continue
    cfg = call.attributes["mhlo.backend_config"]
    for key in ("module", "ir"):
      try:
        found.append((key, ir.StringAttr(cfg[key]).value_bytes))
      except (KeyError, ValueError):
        pass
  return found


def kernel_text(kind: str, data: bytes) -> str:
  """An embedded kernel module printed without locations (Mosaic GPU's deserialized from
  its stable dialect first)."""
  if kind == "ir":  # Triton's dialects live in their own context
    # pylint: disable-next=g-import-not-at-top
    from jax._src.pallas.triton import lowering as triton_lowering
    context = triton_lowering._new_ir_context()  # pylint: disable=protected-access
  else:
    from jax.experimental.mosaic import gpu as mgpu  # pylint: disable=g-import-not-at-top
    context = jax_mlir.make_ir_context()
    mgpu.dialect.register_dialect(context)
    context.allow_unregistered_dialects = True
  with context:
    parsed = ir.Module.parse(data)
    if kind == "module":
      # pylint: disable-next=g-import-not-at-top
      from jax.experimental.mosaic.gpu import core as mgpu_core
      # pylint: disable-next=protected-access
      parsed = mgpu_core._run_serde_pass(parsed, serialize=False)
    return parsed.operation.get_asm(enable_debug_info=False)


def kernel_texts(module) -> list[str]:
  """``kernel_text`` of each of a lowered module's kernels (``kernel_modules``), Mosaic
  GPU's dump name taken out (jax 0.11 numbers it per process): the same kernel lowered
  twice gives the same text on every jax version. (``as_text()`` does not on jax 0.11,
  whose custom call holds the serialized module, that name and a hash included.)"""
  return [re.sub(r'mosaic_gpu\.dump_basename = "[^"]*"', 'mosaic_gpu.dump_basename = ""',
                 kernel_text(*k)) for k in kernel_modules(module)]
