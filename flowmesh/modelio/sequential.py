"""Plain `nn.Sequential`s: containers whose call is calling their children in order, so they can be
opened into a chain (`flowmesh.modelio.chain`) or looked through when tracing (`fx_chain`)."""

from __future__ import annotations

from torch import nn


def is_plain_sequential(module: nn.Module) -> bool:
    """An nn.Sequential whose forward is the stock one: calling it is calling its children."""
    return isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


def sequential_leaves(module: nn.Sequential, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """Children of a plain Sequential in call order, nested plain Sequentials opened."""
    out: list[tuple[str, nn.Module]] = []
    for name, child in module.named_children():
        qual = f"{prefix}{name}"
        if is_plain_sequential(child) and len(child) > 0:
            out += sequential_leaves(child, qual + ".")  # type: ignore[arg-type]
        else:
            out.append((qual, child))
    return out
