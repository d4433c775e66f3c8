"""The msgspec types a Kineto trace's events are decoded into: one struct for any event (`_Event`), and a tagged
union with a struct class per category (`_TaggedDecoder`), whose skipped categories' events are never made into
objects. Where msgspec is not installed, events are decoded as plain dicts (`_typed_decoder()` is None)."""

from __future__ import annotations

from typing import Union

try:  # decodes only the fields used here into slotted structs: about three times faster than dicts
    import msgspec
except ImportError:  # pragma: no cover - the plain-dict path is tested with typed=False
    msgspec = None

if msgspec is not None:

    class _Args(msgspec.Struct, gc=False):
        stream: int | float | str = -1
        correlation: int | float = -1
        external_id: int | float = msgspec.field(default=-1, name="External id")

    class _Event(msgspec.Struct, gc=False):
        name: str = ""
        cat: str = ""
        pid: int | float | str = 0
        tid: int | float | str = 0
        ts: int | float | None = None
        dur: int | float | None = None
        args: _Args = msgspec.field(default_factory=_Args)


    class _Fields(msgspec.Struct, gc=False, tag_field="cat"):
        """An event whose category is told by the struct's class (a tagged union on `cat`)."""

        name: str = ""
        pid: int | float | str = 0
        tid: int | float | str = 0
        ts: int | float | None = None
        dur: int | float | None = None
        args: _Args = msgspec.field(default_factory=_Args)

    class _Passed(msgspec.Struct, gc=False, tag_field="cat"):
        """An event of a category that is not kept: no field of it is decoded into an object."""


def _typed_decoder():
    if msgspec is None:
        return None
    return msgspec.json.Decoder(list[_Event]), msgspec.ValidationError, msgspec.DecodeError


# Kineto's categories (and a few other writers'): each gets its own struct class in the tagged decoder
KNOWN_CATS = ("cpu_op", "user_annotation", "gpu_user_annotation", "gpu_memcpy", "gpu_memset", "kernel",
              "cuda_runtime", "cuda_driver", "cuda_sync", "cuda_event", "cuda_profiler_range", "ac2g", "overhead",
              "cpu_instant_event", "python_function", "Trace", "fwdbwd", "mtia_runtime", "mtia_ccp_events",
              "privateuse1_runtime", "privateuse1_driver", "xpu_runtime", "hpu_op", "collective_comm",
              "gpu_pm_counter", "Kernel", "Memcpy", "Memset", "Runtime", "Driver", "Operator")
TAGGED_CATS_LIMIT = 256  # categories in one tagged decoder; a trace with more is decoded field by field
TAGGED_MISSES = 4  # pieces the tagged decoder could not take, with no new category to add, before it is dropped
_CLASSES: dict[tuple[str, bool], type] = {}  # (category, passed over) -> its struct class
CAT_OF: dict[type, str] = {}  # struct class -> its category
_KEPT_CLASSES: set[type] = set()  # the classes whose events are kept (not _Passed)
_TAGGED: dict[tuple[frozenset, frozenset], object] = {}  # (categories, those passed over) -> decoder


def _tagged_class(cat: str, passed: bool) -> type:
    cls = _CLASSES.get((cat, passed))
    if cls is None:
        cls = msgspec.defstruct(f"_{'Passed' if passed else 'Fields'}{len(_CLASSES)}", [],
                                bases=(_Passed if passed else _Fields,), tag=cat)
        _CLASSES[(cat, passed)] = cls
        CAT_OF[cls] = cat
        if not passed:
            _KEPT_CLASSES.add(cls)
    return cls


class _TaggedDecoder:
    """Decodes a piece of events into one struct class per category, the skipped categories' events into empty
    structs (their names and arguments, most of a Python-stack trace, are never made into objects): about a third
    less time than `_Event` for every event. A piece it cannot take (an event without a string `cat`, a category
    it does not know) is decoded by `_Event` instead, and the new categories join the union."""

    def __init__(self, skipped: frozenset):
        self.skipped = skipped
        self.cats = set(KNOWN_CATS)
        self.misses = 0
        self.decoder = self._build()

    def _build(self):
        key = (frozenset(self.cats), self.skipped)
        if key not in _TAGGED:
            classes = tuple(_tagged_class(c, c in self.skipped) for c in sorted(self.cats))
            _TAGGED[key] = msgspec.json.Decoder(list[Union[classes]])
        return _TAGGED[key]

    def learn(self, events: list) -> bool:
        """After a piece it could not take, decoded by `_Event`: add its new categories. False once it gives up."""
        new = {e.cat for e in events if type(e) is _Event} - self.cats
        if new and len(self.cats) + len(new) <= TAGGED_CATS_LIMIT:
            self.cats |= new
            self.decoder = self._build()
            return True
        self.misses += 1
        return self.misses < TAGGED_MISSES


_TAGS, _STRUCTS, _DICTS = range(3)  # how a piece was decoded: _TaggedDecoder, _Event, plain JSON values
