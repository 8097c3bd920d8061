"""A tokenizer's chat template rendered within bounds of time and size.

A chat template is Jinja code that comes with a tokenizer, from a directory or the Hub.
transformers renders it in Jinja's immutable sandbox, which keeps it from Python's insides
but not from the host's time and memory: nested ``range`` loops run for hours, and
``'a' * 1000000000`` hands the tokenizer a string it aborts the process on. Here the same
template, with transformers' own filters, globals and tags, renders in that sandbox with
two bounds, each refused as ``TemplateLimit``:

- a deadline: every loop iteration, call, filter and operator looks at the clock, so a
  rendering ends within one of those steps of its ``timeout_s``;
- a size: no value the template makes (a string, a list, the rendering itself) may print
  as more than ``max_chars`` characters. A repetition (``*``, ``**``) is weighed before it
  is computed, as is an integer argument (``center(10**9)``); anything else is weighed as it
  is made, and Jinja folds no constant at compile time, so nothing is computed unweighed.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from functools import cached_property, update_wrapper
from itertools import chain

from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

# The filters the bounds add to a template (names a template cannot spell: they start with a dot)
_STEPS, _SIZED = ".steps", ".sized"


class TemplateLimit(Exception):
    """A rendering went past a bound; the message names it and the config field that sets it."""


class _Rendering:
    """One rendering's bounds: its deadline and the characters any value may take."""

    def __init__(self, max_chars: int, timeout_s: float):
        self.max_chars, self.timeout_s = max_chars, timeout_s
        self.deadline = time.monotonic() + timeout_s

    def step(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimit(f"the chat template takes over {self.timeout_s:g} s to render this conversation, "
                                "more than data.chat_template_timeout_s allows")

    def check(self, size: int, what: str = "makes a value of") -> None:
        if size > self.max_chars:
            raise TemplateLimit(f"the chat template {what} {size} characters rendering this conversation, over "
                                f"data.max_document_bytes ({self.max_chars})")

    def sized(self, value):
        self.check(_size(value, {}))
        return value

    def arguments(self, args: tuple, kwargs: dict) -> None:
        """Integer arguments are widths and counts (``center``, ``ljust``, ``zfill``, ``indent``)."""
        for value in chain(args, kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool):
                self.check(value, "asks a call for")


_RENDERING: ContextVar[_Rendering] = ContextVar("chat_template_rendering")


def _size(value, counted: dict[int, int]) -> int:
    """The characters ``value`` takes as text, about: a string's, an integer's digits, and a
    container's items with theirs, a shared item each time it appears (as printing it
    would), each container weighed once (``counted``, by ``id``: ``value`` holds them alive)."""
    if isinstance(value, str | bytes):
        return len(value)
    if isinstance(value, int):
        return value.bit_length() // 3 + 1
    if isinstance(value, Namespace):  # jinja2's namespace() keeps its attributes under this name
        items = object.__getattribute__(value, "_Namespace__attrs")
    elif isinstance(value, dict | list | tuple | set | frozenset):
        items = value
    else:
        return 0
    if id(value) not in counted:
        counted[id(value)] = 1  # a container that holds itself prints it as "[...]"
        parts = chain.from_iterable(items.items()) if isinstance(items, dict) else items
        counted[id(value)] = len(items) + sum(_size(part, counted) for part in parts)
    return counted[id(value)]


def _repeated_size(operator: str, left, right) -> int:
    """What ``left operator right`` will take, weighed before it is computed."""
    if operator == "*":
        for items, times in ((left, right), (right, left)):
            if isinstance(times, int) and isinstance(items, str | list | tuple):
                return _size(items, {}) * max(times, 0)
        if isinstance(left, int) and isinstance(right, int):
            return (left.bit_length() + right.bit_length()) // 3 + 1
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        return left.bit_length() * right // 3 + 1
    return 0


class _Steps:
    """A loop's items, each one a step: the loop keeps its length (``loop.length``, ``loop.last``)."""

    def __init__(self, items):
        self.items = items

    def __iter__(self):
        rendering = _RENDERING.get()
        for item in self.items:
            rendering.step()
            yield item

    def __len__(self) -> int:
        return len(self.items)


def _bounded_filter(function):
    def bounded(*args, **kwargs):
        rendering = _RENDERING.get()
        rendering.step()
        rendering.arguments(args, kwargs)
        return rendering.sized(function(*args, **kwargs))

    return update_wrapper(bounded, function)  # with its pass_context mark, so Jinja passes what it takes


class _Bounding(NodeTransformer):
    """A template's syntax tree with a step at each loop's items, and a size check on what
    Jinja builds without a call or an operator: a literal list, tuple or dict, a ``~``
    concatenation, a ``{% set %}`` block."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, _STEPS, [], [], None, None, lineno=node.lineno)
        return node

    def _sized(self, node: nodes.Expr) -> nodes.Expr:
        node = self.generic_visit(node)
        if getattr(node, "ctx", "load") != "load":  # an assignment's target
            return node
        return nodes.Filter(node, _SIZED, [], [], None, None, lineno=node.lineno)

    visit_List = visit_Tuple = visit_Dict = visit_Concat = _sized

    def visit_AssignBlock(self, node: nodes.AssignBlock) -> nodes.AssignBlock:
        node = self.generic_visit(node)
        if node.filter is None:  # a filter of the block applies to what the block renders (Filter's node None)
            node.filter = nodes.Filter(None, _SIZED, [], [], None, None, lineno=node.lineno)
        return node


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(ImmutableSandboxedEnvironment.default_binop_table)

    def __init__(self, like: ImmutableSandboxedEnvironment):
        # transformers' options and tags, and no constant folded at compile time (unweighed)
        super().__init__(trim_blocks=like.trim_blocks, lstrip_blocks=like.lstrip_blocks, optimized=False,
                         extensions=[type(extension) for extension in like.extensions.values()])
        self.globals.update(like.globals)
        filters = {**like.filters, _SIZED: lambda value: value}
        self.filters = {name: _bounded_filter(function) for name, function in filters.items()}
        self.filters[_STEPS] = _Steps  # a step an item, not one for the whole loop

    def call_binop(self, context, operator: str, left, right):
        rendering = _RENDERING.get()
        rendering.step()
        rendering.check(_repeated_size(operator, left, right))
        return rendering.sized(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's own names: no clash with kwargs)
        rendering = _RENDERING.get()
        rendering.step()
        rendering.arguments(args, kwargs)
        return rendering.sized(super().call(__context, __obj, *args, **kwargs))

    def _parse(self, source, name, filename) -> nodes.Template:
        return _Bounding().visit(super()._parse(source, name, filename))


class ChatTemplate:
    """A chat template compiled with transformers' filters, globals and tags, rendered within
    ``max_chars`` characters and ``timeout_s`` seconds a rendering."""

    def __init__(self, source: str, max_chars: int, timeout_s: float):
        self.source, self.max_chars, self.timeout_s = source, max_chars, timeout_s

    @cached_property
    def _template(self):
        # transformers' own environment, for what it gives a template: a template renders here
        # as apply_chat_template renders it, within bounds
        from transformers.utils.chat_template_utils import _compile_jinja_template

        return _BoundedEnvironment(_compile_jinja_template("").environment).from_string(self.source)

    def render(self, messages: list[dict], add_generation_prompt: bool, variables: dict) -> str:
        """The conversation as text, as ``apply_chat_template(..., tokenize=False)`` renders it;
        ``TemplateLimit`` past a bound."""
        rendering = _Rendering(self.max_chars, self.timeout_s)
        token = _RENDERING.set(rendering)
        try:
            pieces, size = [], 0
            for piece in self._template.generate(messages=messages, tools=None, documents=None,
                                                 add_generation_prompt=add_generation_prompt, **variables):
                size += len(piece)
                rendering.check(size, "makes a rendering of")
                rendering.step()
                pieces.append(piece)
            return "".join(pieces)
        finally:
            _RENDERING.reset(token)
