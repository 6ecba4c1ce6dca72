"""The interpreter: program states, ``@function``, ``run``/``run_batch`` and streaming.

Invariants:
- ``s += expr`` returns at once: the expression's operations are numbered (program steps, counted per
  run in program order) and queued on the state's own single worker thread, so a state executes in
  order while the states of a fork execute concurrently (and the server batches their requests).
- Reading a state (``s["x"]``, ``s.text()``, ``fork``, the end of ``run``) waits for its queue; the
  first failure stops the state and is raised there as ``ProgramError("step N (what): why")``.
- A state's text is ``raw`` + the chat template applied to its finished messages + the opening of the
  message being written + that message's content so far; it only grows while a message is open.
- ``fork(n)`` first sends the shared text once (``Backend.cache_prefix``), so the n branches find it in
  the radix cache instead of all prefilling it at the same moment.
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import itertools
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from radixserve.frontend.backends import Backend, BackendError, Completion
from radixserve.frontend.primitives import ROLES, Expr, Gen, Op, Select, as_expr

_default_backend: Backend | None = None
_DONE = object()


class ProgramError(RuntimeError):
    """A program failed; the message names the step (``step 3 (gen 'ans'): ...``)."""


def set_default_backend(backend: Backend) -> None:
    global _default_backend
    _default_backend = backend


def get_default_backend() -> Backend | None:
    return _default_backend


class _Run:
    """What the states of one program run share: the backend, the step counter, the stream."""

    def __init__(self, backend: Backend, stream: bool) -> None:
        self.backend = backend
        self.steps = itertools.count(1)
        self.lock = threading.Lock()
        self.states: list[ProgramState] = []
        self.chunks: queue.SimpleQueue[Any] | None = queue.SimpleQueue() if stream else None

    def next_step(self) -> int:
        with self.lock:
            return next(self.steps)


class ProgramState:
    """The state ``s`` a program appends to. Also what ``run`` returns."""

    def __init__(self, run: _Run, label: str = "", parent: ProgramState | None = None) -> None:
        self._run = run
        self._label = label
        self._raw: str = parent._raw if parent else ""
        self._messages: list[dict[str, str]] = [dict(m) for m in parent._messages] if parent else []
        self._open: list[str] | None = (
            list(parent._open) if parent and parent._open else None
        )  # [role, content]
        self._vars: dict[str, Any] = dict(parent._vars) if parent else {}
        self._meta: dict[str, Any] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rf-state")
        self._pending: list[concurrent.futures.Future[None]] = []
        self._error: ProgramError | None = None
        self._last_step = "the start"
        self._streamed = ""
        with run.lock:
            run.states.append(self)

    # -- building -------------------------------------------------------------------------------------
    def __iadd__(self, expr: Expr | str) -> ProgramState:
        ops = [(self._run.next_step(), op) for op in as_expr(expr).ops()]
        self._pending.append(self._pool.submit(self._execute, ops))
        return self

    def __setitem__(self, name: str, value: Any) -> None:
        self._pending.append(self._pool.submit(self._vars.__setitem__, name, value))

    def fork(self, n: int) -> ForkList:
        """``n`` copies of this state (text, messages, variables) that continue independently."""
        if n < 1:
            raise ProgramError(f"fork needs n >= 1, got {n}")
        self.sync()
        step = self._run.next_step()
        text = self._text()
        if n > 1 and text:
            try:
                self._run.backend.cache_prefix(text)
            except BackendError as exc:
                raise self._fail(step, f"fork {n}", exc) from None
        self._last_step = f"step {step} (fork {n})"
        prefix = f"{self._label} > " if self._label else ""
        return ForkList(ProgramState(self._run, f"{prefix}fork {i + 1}/{n}", self) for i in range(n))

    # -- reading --------------------------------------------------------------------------------------
    def sync(self) -> ProgramState:
        """Wait until everything appended so far has run; raise the state's ProgramError if one failed."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()
        if self._error is not None:
            raise self._error
        return self

    def __getitem__(self, name: str) -> Any:
        self.sync()
        if name not in self._vars:
            have = ", ".join(sorted(self._vars)) or "none"
            where = f" in {self._label}" if self._label else ""
            raise ProgramError(
                f"after {self._last_step}{where}: no variable named {name!r} (defined: {have})"
            )
        return self._vars[name]

    def __contains__(self, name: str) -> bool:
        return name in self.sync()._vars

    def get_var(self, name: str, default: Any = None) -> Any:
        return self.sync()._vars.get(name, default)

    @property
    def variables(self) -> dict[str, Any]:
        return dict(self.sync()._vars)

    def get_meta_info(self, name: str) -> dict[str, Any]:
        """What the backend reported for the gen or select that set ``name`` (token counts, scores)."""
        self.sync()
        return dict(self._meta.get(name, {}))

    def text(self) -> str:
        return self.sync()._text()

    def messages(self) -> list[dict[str, str]]:
        self.sync()
        return [dict(m) for m in self._messages]

    def text_iter(self) -> Iterator[str]:
        """The text as it is produced (template markers included); only for ``run(..., stream=True)``."""
        chunks = self._run.chunks
        if chunks is None:
            raise ProgramError("text_iter needs run(..., stream=True)")
        while True:
            item = chunks.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def __repr__(self) -> str:
        return f"ProgramState(variables={sorted(self._vars)}, error={self._error})"

    # -- executing (on the state's worker thread) -------------------------------------------------------
    def _execute(self, ops: list[tuple[int, Op]]) -> None:
        for step, op in ops:
            if self._error is not None:
                return
            try:
                self._do(op)
            except Exception as exc:  # any failure becomes the state's error, raised at the next read
                self._error = self._fail(step, op.description, exc)
                return
            self._last_step = f"step {step} ({op.description})"
            self._emit()

    def _fail(self, step: int, what: str, exc: BaseException) -> ProgramError:
        where = f" in {self._label}" if self._label else ""
        err = ProgramError(f"step {step} ({what}{where}): {exc}")
        err.__cause__ = exc
        return err

    def _do(self, op: Op) -> None:
        if op.kind == "text":
            self._append(op.expr.text)
        elif op.kind == "open":
            if op.expr.role not in ROLES:
                raise ValueError(f"unknown role {op.expr.role!r}")
            if self._open is not None:
                raise ValueError(f"cannot start a {op.expr.role} message inside the {self._open[0]} message")
            self._open = [op.expr.role, ""]
        elif op.kind == "close":
            assert self._open is not None
            self._messages.append({"role": self._open[0], "content": self._open[1]})
            self._open = None
        elif op.kind == "gen":
            self._gen(op.expr)
        else:
            self._select(op.expr)

    def _gen(self, g: Gen) -> None:
        on_text = self._stream_piece if self._run.chunks is not None and not self._label else None
        done: Completion = self._run.backend.generate(self._text(), g.sampling_params(), on_text)
        self._append(done.text)
        if g.name is not None:
            self._vars[g.name] = done.text
            self._meta[g.name] = {
                "prompt_tokens": done.prompt_tokens,
                "cached_tokens": done.cached_tokens,
                "completion_tokens": done.completion_tokens,
                "finish_reason": done.finish_reason,
            }

    def _select(self, sel: Select) -> None:
        scores = self._run.backend.score(self._text(), sel.choices)
        values = [sum(s) / len(s) if sel.method == "normalized" else sum(s) for s in scores]
        best = max(range(len(values)), key=lambda i: values[i])
        self._append(sel.choices[best])
        if sel.name is not None:
            self._vars[sel.name] = sel.choices[best]
            self._meta[sel.name] = {
                "scores": dict(zip(sel.choices, values, strict=True)),
                "method": sel.method,
                "token_logprobs": dict(zip(sel.choices, scores, strict=True)),
            }

    def _append(self, text: str) -> None:
        if self._open is not None:
            self._open[1] += text
        elif self._messages:  # raw text after a conversation: the conversation so far becomes raw text
            self._raw = self._text() + text
            self._messages = []
        else:
            self._raw += text

    def _text(self) -> str:
        if not self._messages and self._open is None:
            return self._raw
        template = self._run.backend.chat_template
        rendered = template.render(self._messages, None if self._open is None else self._open[0])
        return self._raw + rendered + (self._open[1] if self._open is not None else "")

    def _stream_piece(self, piece: str) -> None:
        assert self._run.chunks is not None
        self._streamed += piece
        self._run.chunks.put(piece)

    def _emit(self) -> None:
        if self._run.chunks is None or self._label:
            return
        text = self._text()
        if text.startswith(self._streamed) and len(text) > len(self._streamed):
            self._run.chunks.put(text[len(self._streamed) :])
        self._streamed = text

    def _close(self) -> None:
        self._pool.shutdown(wait=False)


class ForkList(list[ProgramState]):
    """The branches of ``fork``; ``join()`` waits for all of them (raising the first failure)."""

    def join(self) -> ForkList:
        for state in self:
            state.sync()
        return self


class Function:
    """A program: ``@rf.function`` over ``def f(s, **arguments)``."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.arg_names = list(inspect.signature(fn).parameters)[1:]
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    def run(
        self, *args: Any, backend: Backend | None = None, stream: bool = False, **kwargs: Any
    ) -> ProgramState:
        """Run the program and return its final state (raising ProgramError on failure).

        With ``stream=True`` it returns at once; iterate ``state.text_iter()`` for the text as it comes.
        """
        be = _backend(backend)
        run = _Run(be, stream)
        state = ProgramState(run)
        if not stream:
            self._run(state, args, kwargs)
            return state

        def target() -> None:
            assert run.chunks is not None
            try:
                self._run(state, args, kwargs)
                run.chunks.put(_DONE)
            except BaseException as exc:
                run.chunks.put(exc)

        threading.Thread(target=target, name="rf-stream", daemon=True).start()
        return state

    def run_batch(
        self,
        batch_kwargs: Sequence[dict[str, Any]],
        backend: Backend | None = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
    ) -> list[ProgramState]:
        """Run the program once per argument dict, ``num_threads`` at a time; states come back in order.

        A failing run raises its ProgramError, prefixed with the index of its arguments.
        """
        be = _backend(backend)
        threads = min(64, max(1, len(batch_kwargs))) if num_threads == "auto" else int(num_threads)
        bar = None
        if progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=len(batch_kwargs), desc=self.fn.__name__)

        def one(i: int) -> ProgramState:
            try:
                return self.run(backend=be, **batch_kwargs[i])
            except ProgramError as exc:
                raise ProgramError(f"batch item {i}: {exc}") from exc.__cause__
            finally:
                if bar is not None:
                    bar.update(1)

        try:
            with concurrent.futures.ThreadPoolExecutor(
                max(1, threads), thread_name_prefix="rf-batch"
            ) as pool:
                return list(pool.map(one, range(len(batch_kwargs))))
        finally:
            if bar is not None:
                bar.close()

    def _run(self, state: ProgramState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            bound = inspect.signature(self.fn).bind(state, *args, **kwargs)
        except TypeError as exc:
            raise ProgramError(f"{self.fn.__name__}: {exc}") from None
        try:
            self.fn(*bound.args, **bound.kwargs)
            for s in list(state._run.states):
                s.sync()
        finally:
            for s in list(state._run.states):
                s._close()


def function(fn: Callable[..., Any]) -> Function:
    """Decorator: turn ``def program(s, ...)`` into a runnable program."""
    return Function(fn)


def _backend(backend: Backend | None) -> Backend:
    be = backend or _default_backend
    if be is None:
        raise ProgramError("no backend: pass backend=... or call rf.set_default_backend(...)")
    return be
