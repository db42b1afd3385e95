"""Nested param dicts <-> flat dotted paths (``model.layers_0.self_attn.q_proj.kernel``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def unwrap_params(tree: Mapping) -> Mapping:
    """Accept both ``{'params': {...}}`` (Flax variables) and the bare param dict."""
    if isinstance(tree, Mapping) and set(tree) == {"params"}:
        return tree["params"]
    return tree


def flatten_params(tree: Mapping) -> dict[str, Any]:
    """Leaves by dotted path, in sorted order; non-dict containers are rejected with their path."""
    flat: dict[str, Any] = {}

    def walk(node, prefix):
        if isinstance(node, Mapping):
            for key in sorted(node, key=str):
                if not isinstance(key, str):
                    raise TypeError(f"param tree key {key!r} under '{prefix or '<root>'}' is not a string")
                walk(node[key], f"{prefix}.{key}" if prefix else key)
        elif isinstance(node, (list, tuple)):
            raise TypeError(f"param tree node '{prefix}' is a {type(node).__name__}; expected nested dicts of arrays")
        else:
            if prefix in flat:
                raise ValueError(
                    f"param tree path '{prefix}' appears twice (a key containing '.' repeats a nested path)"
                )
            flat[prefix] = node

    walk(unwrap_params(tree), "")
    return flat


def unflatten_params(flat: Mapping[str, Any]) -> dict:
    """Nested dicts of ``flat``'s leaves; ValueError for a path that is both a leaf and a prefix
    of another (``a.gate_proj`` and ``a.gate_proj.kernel``)."""
    tree: dict = {}
    for path, leaf in flat.items():
        node = tree
        *parents, last = path.split(".")
        for depth, key in enumerate(parents):
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ValueError(f"param path '{path}' continues past the leaf '{'.'.join(parents[: depth + 1])}'")
        if isinstance(node.get(last), dict):
            raise ValueError(f"param path '{path}' is a leaf and the prefix of other paths")
        node[last] = leaf
    return tree


def path_mismatch(missing: list[str], extra: list[str], shown: int = 8) -> str:
    """The words ``missing N expected path(s): a, b; M unexpected path(s): c``, naming only what
    is there (the first ``shown`` of each)."""
    parts = []
    if missing:
        parts.append(f"missing {len(missing)} expected path(s): {', '.join(missing[:shown])}")
    if extra:
        parts.append(f"{len(extra)} unexpected path(s): {', '.join(extra[:shown])}")
    return "; ".join(parts)
