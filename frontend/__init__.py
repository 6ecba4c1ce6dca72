"""The structured-generation DSL (imported as ``radixserve.frontend``).

    import radixserve.frontend as rf

    @rf.function
    def qa(s, question):
        s += rf.user(question) + rf.assistant(rf.gen("answer", max_tokens=64))

    rf.set_default_backend(rf.RuntimeEndpoint("http://127.0.0.1:8000"))
    print(qa.run(question="Why is the sky blue?")["answer"])

See docs/frontend.md.
"""

from radixserve.frontend.backends import (
    Backend,
    BackendError,
    ChatTemplate,
    Completion,
    LocalEngine,
    RuntimeEndpoint,
)
from radixserve.frontend.primitives import assistant, gen, select, system, user
from radixserve.frontend.program import (
    ForkList,
    Function,
    ProgramError,
    ProgramState,
    function,
    get_default_backend,
    set_default_backend,
)

__all__ = [
    "Backend",
    "BackendError",
    "ChatTemplate",
    "Completion",
    "ForkList",
    "Function",
    "LocalEngine",
    "ProgramError",
    "ProgramState",
    "RuntimeEndpoint",
    "assistant",
    "function",
    "gen",
    "get_default_backend",
    "select",
    "set_default_backend",
    "system",
    "user",
]
