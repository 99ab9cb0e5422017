"""``%config Nbmem``: the traitlets class over ``nbmem.options``, so IPython's config system sets nbmem's
options and every value is checked by the options' own rules (a bad one refused in one line, the old kept)."""

from __future__ import annotations

from typing import Any

from traitlets import Bool, Enum, Float, Int, TraitType
from traitlets.config import Configurable

from nbmem.options import OPTION_BY_NAME, OPTIONS, Option, OptionError, Settings


def _trait(o: Option) -> TraitType[Any, Any]:
    text = f"{o.help} Allowed: {o.allowed()}."
    if o.choices:
        return Enum(list(o.choices), o.default, help=text).tag(config=True)
    if o.kind is bool:
        return Bool(o.default, help=text).tag(config=True)
    if o.kind is int:
        return Int(o.default, help=text).tag(config=True)
    return Float(o.default, help=text).tag(config=True)


class _Options(Configurable):
    """Checks every value through ``nbmem.options`` and refuses bad ones with one line, keeping the old one."""

    def __init__(self, *, notify: Any = print, **kwargs: Any) -> None:
        self._notify = notify
        super().__init__(**kwargs)

    def _load_config(self, cfg: Any, section_names: Any = None, traits: Any = None) -> None:
        for name, value in self._find_my_config(cfg).items():
            opt = OPTION_BY_NAME.get(name)
            if opt is None:
                self._notify(f"nbmem: Nbmem has no option {name!r}; options: {', '.join(OPTION_BY_NAME)}.")
                continue
            if hasattr(value, "get_value"):  # a value from the command line or a lazy container
                try:
                    value = value.get_value(self.traits()[name])
                except Exception:
                    value = str(value)
            try:
                setattr(self, name, opt.check(value))
            except OptionError as e:
                self._notify(f"nbmem: {e}; kept {getattr(self, name)!r}.")

    @classmethod
    def class_get_help(cls, inst: Any = None) -> str:
        """What ``%config Nbmem`` prints: nbmem's options under their own title (traitlets' names the class)."""
        head = "nbmem's options: `%config Nbmem.NAME = VALUE` sets one (e.g. `%config Nbmem.threshold = 0`)"
        traits = sorted(cls.class_traits(config=True).items())  # "=" under it: `%config` cuts a line's leading "--"
        return "\n".join([head, "=" * len(head), *(cls.class_get_trait_help(t, inst) for _, t in traits)])

    def settings(self) -> Settings:
        return Settings(**{o.attr: getattr(self, o.name) for o in OPTIONS})


Nbmem = type("Nbmem", (_Options,), {"__doc__": "nbmem's options (%config Nbmem lists them).",
                                    **{o.name: _trait(o) for o in OPTIONS}})
