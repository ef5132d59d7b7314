"""Replacing a method of one module instance, reversibly and picklably.

leanbp changes behaviour per instance (a streamed model's forwards, an approximated model's
``save_pretrained`` and post-LN residual forwards), never per class. ``types.MethodType`` of a
closure would do that, but a model holding one cannot be pickled (``torch.save(model)``) or
inspected for its signature the way Trainer and ``generate`` do. ``InstanceMethod`` can.
"""

from __future__ import annotations

import inspect

from torch import nn


class InstanceMethod:
    """``owner.<name>(*args, **kwargs)`` -> ``impl(owner, plain, *bound, *args, **kwargs)``, where
    ``plain`` is what it replaced: an earlier instance attribute (another wrapper) or the class's
    method. ``impl`` must be a module-level function (it is pickled by reference)."""

    def __init__(self, owner: nn.Module, name: str, impl, bound: tuple = ()):
        self.owner, self.name, self.impl, self.bound = owner, name, impl, bound
        self.inner = vars(owner).get(name)

    def plain(self):
        if self.inner is not None:
            return self.inner
        return getattr(type(self.owner), self.name).__get__(self.owner, type(self.owner))

    @property
    def __signature__(self):
        return inspect.signature(self.plain())

    def __call__(self, *args, **kwargs):
        return self.impl(self.owner, self.plain(), *self.bound, *args, **kwargs)


def install(owner: nn.Module, name: str, impl, bound: tuple = ()) -> InstanceMethod:
    method = InstanceMethod(owner, name, impl, bound)
    setattr(owner, name, method)
    return method


def installed(owner: nn.Module, name: str, impl=None) -> InstanceMethod | None:
    """The InstanceMethod at ``owner.<name>`` (with that ``impl``, if given), or None."""
    method = vars(owner).get(name)
    if isinstance(method, InstanceMethod) and (impl is None or method.impl is impl):
        return method
    return None


def uninstall(owner: nn.Module, name: str, impl=None) -> None:
    """Put back what ``install`` (of ``impl``, if given) replaced. (A wrapper installed on top since
    stays; the caller makes the buried method pass calls through.)"""
    method = installed(owner, name, impl)
    if method is None:
        return
    if method.inner is None:
        delattr(owner, name)  # the class's method shows through again
    else:
        setattr(owner, name, method.inner)
