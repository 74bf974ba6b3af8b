"""Package names imported on first use (PEP 562), for the packages every process touches.

Every process of a run converts its config to ``RunConfig`` and the launcher checks it, reading
names (enums, config dataclasses, constants) from packages whose other modules import torch,
Megatron or math-verify. A package ``__init__`` that imported its modules eagerly would make the
launcher pay those imports (seconds) before its first child starts. Such a package lists where each
public name lives and hands the lookup to ``lazy_exports``; ``from package import name`` works as before.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping, MutableMapping


def lazy_exports(package: str, homes: Mapping[str, str], namespace: MutableMapping[str, Any],
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` of ``package``, whose name ``n`` lives in module
    ``package.homes[n]``; a name once imported is kept in ``namespace`` (the package's globals)."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{home}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(homes))

    return __getattr__, __dir__, sorted(homes)
