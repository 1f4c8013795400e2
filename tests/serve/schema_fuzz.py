"""Request bodies generated from the msgspec schemas themselves, valid and mutated.

`valid(T)` draws JSON bodies that decode as struct T (every field, union member, literal and
numeric bound comes from `msgspec.inspect.type_info(T)`), with `overrides` steering fields the
server checks beyond the schema (the model name, small token counts). `invalid(T)` draws a valid
body and breaks it in one place the schema forbids: a required field dropped, a value of a kind
the field does not accept, a number past its bound, or JSON nested
deeper than the server reads. `risky(T)` makes one value huge (a long text, 1e308, 2**64):
fine or refused, never a failure.
"""

from __future__ import annotations

from typing import Any

import msgspec.inspect as mi
from hypothesis import strategies as st

SearchStrategy = st.SearchStrategy
TEXT = st.text('ab <|>{}"\\/é\n', max_size=12)
SAMPLE_OF_KIND = {
    "null": None,
    "bool": True,
    "int": 7,
    "float": 0.5,
    "str": "x",
    "array": [],
    "object": {},
}
small_json = st.recursive(
    st.none() | st.booleans() | st.integers(-9, 9) | TEXT,
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(TEXT, inner, max_size=2),
    max_leaves=4,
)


# ---------------------------------------------------------------- valid bodies


def _bounds(t, below: float, width: float) -> tuple[float | None, float | None]:
    lo = t.ge if t.ge is not None else (t.gt if t.gt is not None else None)
    hi = t.le if t.le is not None else (t.lt if t.lt is not None else None)
    if lo is None and hi is None:
        return below, below + width
    if lo is None:
        return hi - width, hi
    return lo, hi if hi is not None else lo + width


def valid(
    t: Any, overrides: dict[str, SearchStrategy] | None = None, always: frozenset = frozenset()
) -> SearchStrategy:
    """Values that decode as msgspec type `t` (a type, or a msgspec.inspect.Type); fields named
    in `always` are always given (for rules beyond the types, such as `__post_init__` checks)."""
    overrides = overrides or {}
    t = t if isinstance(t, mi.Type) else mi.type_info(t)
    match t:
        case mi.StructType():
            required, optional = {}, {}
            for f in t.fields:
                name = f.encode_name
                strategy = (
                    overrides[name] if name in overrides else valid(f.type, overrides, always)
                )
                given = f.required or f.encode_name in always
                (required if given else optional)[f.encode_name] = strategy
            if t.tag_field is not None:
                required[t.tag_field] = st.just(t.tag)
            return st.fixed_dictionaries(required, optional=optional)
        case mi.UnionType():
            return st.one_of([valid(m, overrides, always) for m in t.types])
        case mi.LiteralType():
            return st.sampled_from(t.values)
        case mi.StrType():
            return st.text('ab <|>{}"\\/é\n', min_size=t.min_length or 0, max_size=12)
        case mi.BoolType():
            return st.booleans()
        case mi.NoneType():
            return st.none()
        case mi.IntType():
            lo, hi = _bounds(t, -5, 20)
            lo = lo + 1 if t.gt is not None else lo
            hi = hi - 1 if t.lt is not None else hi
            return st.integers(int(lo), int(hi))
        case mi.FloatType():
            lo, hi = _bounds(t, -5.0, 20.0)
            return st.floats(lo, hi, exclude_min=t.gt is not None, exclude_max=t.lt is not None)
        case mi.ListType():
            size = t.min_length or 0
            return st.lists(
                valid(t.item_type, overrides, always),
                min_size=size,
                max_size=max(size, min(t.max_length or 3, 3)),
            )
        case mi.DictType():
            keys = st.integers(0, 99).map(str) if isinstance(t.key_type, mi.IntType) else TEXT
            return st.dictionaries(keys, valid(t.value_type, overrides, always), max_size=2)
        case mi.AnyType():
            return small_json
    raise TypeError(f"no strategy for {t}")


# ---------------------------------------------------------------- where a body can be broken


def kinds(t: mi.Type) -> set[str]:
    """The JSON kinds a type accepts (a float field takes integers too)."""
    match t:
        case mi.UnionType():
            return set().union(*(kinds(m) for m in t.types))
        case mi.LiteralType():
            return {"str" if isinstance(v, str) else "int" for v in t.values}
        case mi.StructType() | mi.DictType():
            return {"object"}
        case mi.ListType():
            return {"array"}
        case mi.FloatType():
            return {"int", "float"}
        case mi.AnyType():
            return set(SAMPLE_OF_KIND)
        case mi.IntType():
            return {"int"}
        case mi.StrType():
            return {"str"}
        case mi.BoolType():
            return {"bool"}
        case mi.NoneType():
            return {"null"}
    raise TypeError(f"no JSON kind for {t}")


def kind_of(value) -> str:
    return {
        type(None): "null",
        bool: "bool",
        int: "int",
        float: "float",
        str: "str",
        list: "array",
        dict: "object",
    }[type(value)]


def member_for(t: mi.Type, value) -> mi.Type:
    """The union member a value was drawn from (the first that takes its kind and tag)."""
    if not isinstance(t, mi.UnionType):
        return t
    for member in t.types:
        tagged = isinstance(member, mi.StructType) and member.tag_field is not None
        if kind_of(value) in kinds(member) and not (
            tagged and value.get(member.tag_field) != member.tag
        ):
            return member
    raise ValueError(f"{value!r} matches no member of {t}")


def sites(t: mi.Type, value, path: tuple = ()) -> list[tuple[tuple, mi.Type, bool]]:
    """(path, type, required) of every value in `value` and of every absent required field."""
    found = []
    t = member_for(t, value)
    if isinstance(t, mi.StructType):
        for f in t.fields:
            if f.encode_name in value:
                found.append(((*path, f.encode_name), f.type, f.required))
                found += sites(f.type, value[f.encode_name], (*path, f.encode_name))
    elif isinstance(t, mi.ListType):
        for i, item in enumerate(value):
            found.append(((*path, i), t.item_type, True))
            found += sites(t.item_type, item, (*path, i))
    elif isinstance(t, mi.DictType):
        for k, item in value.items():
            found += sites(t.value_type, item, (*path, k))
    return found


def accepts(m: mi.Type, number) -> bool:
    if isinstance(m, mi.AnyType):
        return True
    if not isinstance(m, (mi.IntType, mi.FloatType)):
        return False
    if isinstance(m, mi.IntType) and not isinstance(number, int):
        return False
    return not (
        (m.ge is not None and number < m.ge)
        or (m.gt is not None and number <= m.gt)
        or (m.le is not None and number > m.le)
        or (m.lt is not None and number >= m.lt)
    )


def out_of_range(t: mi.Type) -> list:
    """Numbers just past a bound of a numeric member of `t` that no member accepts."""
    members = t.types if isinstance(t, mi.UnionType) else (t,)
    past = []
    for m in members:
        if isinstance(m, (mi.IntType, mi.FloatType)):
            step = 1 if isinstance(m, mi.IntType) else 0.5
            past += [m.ge - step] if m.ge is not None else []
            past += [m.gt] if m.gt is not None else []
            past += [m.le + step] if m.le is not None else []
            past += [m.lt] if m.lt is not None else []
    return [v for v in past if not any(accepts(m, v) for m in members)]


def replaced(body, path: tuple, value):
    """A copy of body with the value at path replaced (or removed, for value DROP)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(body, list):
        copy = list(body)
    else:
        copy = dict(body)
    if not rest and value is DROP:
        del copy[head]
    else:
        copy[head] = replaced(body[head], rest, value)
    return copy


DROP = object()


def deeply_nested(depth: int):
    value: Any = 1
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


@st.composite
def invalid(draw, t: Any, overrides: dict | None = None, always: frozenset = frozenset()):
    """(body, what was broken): a valid body broken where the schema forbids it."""
    info = t if isinstance(t, mi.Type) else mi.type_info(t)
    body = draw(valid(info, overrides, always))
    places = sites(info, body)
    breaks = [("too deep", (), None)]
    breaks += [
        (f"{p} dropped", p, DROP)
        for p, _, required in places
        if required and p and not isinstance(p[-1], int)
    ]
    for p, ft, _ in places:
        wrong = sorted(set(SAMPLE_OF_KIND) - kinds(ft))
        breaks += [(f"{p} as {k}", p, SAMPLE_OF_KIND[k]) for k in wrong]
        breaks += [(f"{p} = {v}", p, v) for v in out_of_range(ft)]
        if isinstance(member_for(ft, body_at(body, p)), mi.AnyType):
            breaks.append((f"{p} nested too deep", p, deeply_nested(80)))
    what, path, value = draw(st.sampled_from(breaks))
    if what == "too deep":
        return {**body, "extra": deeply_nested(80)}, what
    return replaced(body, path, value), what


def body_at(body, path: tuple):
    for key in path:
        body = body[key]
    return body


@st.composite
def risky(draw, t: Any, overrides: dict | None = None, always: frozenset = frozenset()):
    """(body, what): a valid body with one string or number made huge; may be fine or not."""
    info = t if isinstance(t, mi.Type) else mi.type_info(t)
    body = draw(valid(info, overrides, always))
    places = [(p, ft) for p, ft, _ in sites(info, body)]
    huge = []
    for p, ft in places:
        if "str" in kinds(ft):
            huge.append((f"{p} huge text", p, "é" * 5_000))
        if "float" in kinds(ft):
            huge += [(f"{p} = 1e308", p, 1e308), (f"{p} = -1e308", p, -1e308)]
        if "int" in kinds(ft):
            huge += [(f"{p} = 2**64", p, 2**64), (f"{p} = -(2**64)", p, -(2**64))]
    if not huge:
        return body, "unchanged"
    what, path, value = draw(st.sampled_from(huge))
    return replaced(body, path, value), what
