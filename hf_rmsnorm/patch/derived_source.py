"""The forward a class runs, read from its modeling file and proven to be that very function; and a tree of it
compiled back into a function as the class body compiled the original.

A derived forward (``derived_rewrite.py``) is a class's forward with a few statements rewritten, so before one is
derived two things must hold, and ``class_forward`` checks both:

* **The class runs the forward its modeling module defines** (``foreign_forward``). ``cls.forward`` is the ``def
  forward`` in the body of the class of ``cls``'s MRO that defines it (an inherited forward is its parent's), with
  the decorators written above it and nothing else, transformers' own wrapper aside (``GradientCheckpointingLayer``
  wraps every subclass's forward when the class is created). A function another library set on the class, or a
  wrapper it put around the forward, is foreign code: ``functools.wraps`` copies a function's name, module and
  docstring, never its code, so each function is known by its code (``co_qualname``, and ``__globals__``, its
  module's namespace).
* **The source read is the code running.** The def as the file holds it now, compiled as its class body compiled
  it (private names mangled with the class's name, the module's future features, zero-argument ``super()``),
  then decorated by the expressions written above it, equals the running function in full: each function's code,
  defaults and keyword defaults, the values its closure holds (a decorator's arguments) and what it wraps. A file
  edited since it was imported (an editable install, an upgrade under a running process) differs somewhere, and
  the difference is the reason given.

The class's def is found by the class's qualified name in the parsed file, not by line numbers: lines above it may
move without changing it, and the derived forward then carries the file's current lines, which tracebacks read.
A derived forward takes its defaults and keyword defaults from the running function (the same values, shown equal;
the same objects too), and its decorators are the source's expressions, shown above to build the running ones.
"""

from __future__ import annotations

import __future__
import ast
import copy
import dis
import functools
import inspect
import linecache
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass

from .instance_forwards import function_path

# The parameter the compiled factory takes the derived forwards' helpers by (``derived_runtime``), which they call
# as ``_hf_rmsnorm_derived.<name>``.
HELPERS = "_hf_rmsnorm_derived"


def helper_call(name: str, *args: ast.expr) -> ast.Call:
    """The call ``_hf_rmsnorm_derived.<name>(*args)`` of a derived forward's helper."""
    return ast.Call(ast.Attribute(ast.Name(HELPERS, ast.Load()), name, ast.Load()), list(args), [])


@dataclass(frozen=True)
class ClassForward:
    """A class's running forward, shown to be its source's def: ``definer`` the class whose body defines it;
    ``node`` that def as the file holds it now (a parse of its own, the file's positions, decorators included);
    ``running`` the function the class calls (transformers' checkpointing wrapper aside) and ``undecorated`` the
    def's own function inside it, whose defaults a derived forward takes."""

    definer: type
    node: ast.FunctionDef
    running: types.FunctionType
    undecorated: types.FunctionType


@dataclass(frozen=True)
class _Difference:
    """Where the running forward and its source's compilation part: ``foreign`` when a function of neither the
    source nor its decorators runs (another library's wrapper or replacement), else the file changed."""

    foreign: bool
    text: str


def foreign_forward(cls: type) -> str | None:
    """Why ``cls.forward`` is not the forward its modeling module defines, if it is not: another library's function
    set on the class, or a wrapper around the def that is none of its decorators. A def whose body changed on disk
    since import is still the module's own: that matters only to what is derived from the source
    (``class_forward``)."""
    located = _located(cls)
    if isinstance(located, _Difference):
        return located.text if located.foreign else f"cannot tell whether foreign code wraps it: {located.text}"
    definer, running, node = located
    if node is None:  # the def itself, no wrapper: nothing foreign can run
        return None
    built = _built_from_source(definer, node)
    if isinstance(built, str):
        return f"cannot tell whether {cls.__qualname__}.forward is wrapped by foreign code: {built}"
    fresh, bare = built
    difference = _difference(running, fresh, _Context(definer, node, bare))
    return difference.text if difference is not None and difference.foreign else None


def class_forward(cls: type) -> ClassForward | str:
    """``cls``'s running forward and its def, or why no forward may be derived from that source (module
    docstring)."""
    located = _located(cls)
    if isinstance(located, _Difference):
        return located.text
    definer, running, node = located
    if node is None:
        node = _forward_def(definer)
        if isinstance(node, str):
            return node
    built = _built_from_source(definer, node)
    if isinstance(built, str):
        return built
    fresh, bare = built
    context = _Context(definer, node, bare)
    difference = _difference(running, fresh, context)
    if difference is not None:
        return difference.text
    if context.live_def is None:
        return f"{cls.__qualname__}.forward: the def's own function cannot be found inside its decorators"
    if context.live_def.__code__.co_flags & (inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR):
        return f"{cls.__qualname__}.forward is a generator or coroutine function"
    return ClassForward(definer, copy.deepcopy(node), running, context.live_def)


def compile_forward(forward: ClassForward, node: ast.FunctionDef, helpers: types.ModuleType,
                    bound: Mapping[str, object] | None = None) -> types.FunctionType:
    """``node`` (``forward.node`` rewritten) compiled as ``forward``'s class body compiled the original, its
    defaults and keyword defaults those of the running function (keyword-only parameters the rewrite added keep
    their own), reaching ``helpers`` as ``HELPERS`` and each value of ``bound`` by its name, then decorated by the
    def's decorators."""
    function = _compiled(forward.definer, node, helpers, bound)
    function.__defaults__ = forward.undecorated.__defaults__
    function.__kwdefaults__ = {**(function.__kwdefaults__ or {}), **(forward.undecorated.__kwdefaults__ or {})}
    return _decorated(function, node.decorator_list, forward.definer)


# ------------------------------------------------------------------------------------- the running function


def _checkpointing_code() -> types.CodeType | None:
    """The code of transformers' ``GradientCheckpointingLayer`` wrapper of a subclass's forward (transformers
    5.24 wraps it when the class is created; earlier releases wrap ``__call__`` and have none)."""
    layer = getattr(sys.modules.get("transformers.modeling_layers"), "GradientCheckpointingLayer", None)
    hook = getattr(getattr(layer, "__dict__", {}).get("__init_subclass__"), "__func__", None)
    consts = hook.__code__.co_consts if isinstance(hook, types.FunctionType) else ()
    return next((c for c in consts if isinstance(c, types.CodeType) and c.co_name == "forward_with_checkpointing"),
                None)


def _without_checkpointing(function: object) -> object:
    """``function`` without transformers' checkpointing wrappers (one per class of the MRO that has one)."""
    code = _checkpointing_code()
    while isinstance(function, types.FunctionType) and code is not None and function.__code__ is code:
        function = _cells(function)["forward"]
    return function


def _located(cls: type) -> tuple[type, types.FunctionType, ast.FunctionDef | None] | _Difference:
    """``(definer, running, def)``: the class whose body defines ``cls``'s running forward and that forward; the
    def as the file holds it now, or None when the running function is that def itself, wrapped by nothing (its
    code is the definer's ``forward``, and nothing wraps it), so there is no decorator to check."""
    owner = next((c for c in cls.__mro__ if "forward" in c.__dict__), None)
    running = _without_checkpointing(owner.__dict__["forward"]) if owner is not None else None
    if not isinstance(running, types.FunctionType):
        return _Difference(True, f"{cls.__qualname__}.forward is a {type(running).__qualname__}, not a function")
    innermost = inspect.unwrap(running)
    qualname, module = innermost.__code__.co_qualname, innermost.__globals__.get("__name__")
    definer = next((c for c in cls.__mro__ if f"{c.__qualname__}.forward" == qualname and c.__module__ == module),
                   None)
    if definer is None:
        # A wrapper that hides what it wraps, a source decorator alike: the class holding it, if its source says so.
        definer = next(c for c in cls.__mro__ if _without_checkpointing(c.__dict__.get("forward")) is running)
        node = _forward_def(definer)
        if isinstance(node, str) or not node.decorator_list:
            return _Difference(True, _foreign_text(cls, running))
        return definer, running, node
    if innermost is running:  # its code is the def's, and nothing says it wraps another function
        return definer, running, None
    node = _forward_def(definer)
    return (definer, running, node) if not isinstance(node, str) else _Difference(False, node)


_ONLY_ITS_OWN = "patch_model only patches the forward transformers defines"


def _foreign_text(cls: type, function: object) -> str:
    return f"{cls.__qualname__}.forward was replaced by {function_path(function)}; {_ONLY_ITS_OWN}"


def _cells(function: types.FunctionType) -> dict[str, object]:
    """The values ``function``'s closure holds, by name (an empty cell's is the cell itself)."""
    values = {}
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ()):
        try:
            values[name] = cell.cell_contents
        except ValueError:
            values[name] = cell
    return values


# ------------------------------------------------------------------------------------- the source


def _forward_def(definer: type) -> ast.FunctionDef | str:
    """The ``def forward`` of ``definer``'s class body, as its file holds it now (the tree is shared: copy before
    changing it), or why it cannot be read."""
    if "<locals>" in definer.__qualname__:
        return f"{definer.__qualname__} is defined inside a function: its source cannot be compiled apart"
    source = _module_source(sys.modules.get(definer.__module__))
    if isinstance(source, str):
        return source
    filename, tree = source
    statements: list[ast.stmt] = tree.body
    for name in definer.__qualname__.split("."):
        found = _last_binding(statements, name)
        if not isinstance(found, ast.ClassDef):
            return (f"no class statement of {filename} as it is now defines {definer.__qualname__} (the file changed "
                    "since it was imported, or the class was made otherwise)")
        statements = found.body
    found = _last_binding(statements, "forward")
    if not isinstance(found, ast.FunctionDef):
        return f"the body of {definer.__qualname__} in {filename} has no def forward"
    return found


def _module_source(module: types.ModuleType | None) -> tuple[str, ast.Module] | str:
    """The file name of ``module`` and the tree of its text as the file holds it now (shared: copy before changing
    it), or why it cannot be read."""
    try:
        filename = inspect.getsourcefile(module)
    except TypeError:
        filename = None
    if not filename:
        return f"the source of {getattr(module, '__name__', module)} cannot be read"
    linecache.checkcache(filename)
    tree = _parsed_file("".join(linecache.getlines(filename, module.__dict__)), filename)
    return tree if isinstance(tree, str) else (filename, tree)


def module_function(function: types.FunctionType) -> ast.FunctionDef | str:
    """The undecorated def at the top level of ``function``'s module that ``function`` is, as the file holds it
    now, shown to compile (with the file's future features, as the module did) to ``function``'s very code; or why
    it is not such a def. Its defaults are not read: what the caller derives from the def must not rely on them."""
    module = sys.modules.get(function.__module__)
    name = function.__code__.co_name
    if module is None or function.__globals__ is not module.__dict__ or function.__code__.co_qualname != name:
        return f"{function_path(function)} is no function defined at the top level of its module"
    if function.__closure__ is not None:
        return f"{function_path(function)} holds a closure"
    source = _module_source(module)
    if isinstance(source, str):
        return source
    filename, tree = source
    node = _last_binding(tree.body, name)
    if not isinstance(node, ast.FunctionDef) or node.decorator_list:
        return f"the last binding of {name} in {filename} is no undecorated def"
    imported, features = _module_facts(tree)
    body: list[ast.stmt] = [copy.deepcopy(node)]
    if imported:  # as in ``_compiled``: the names the module imports compile as imports
        body.insert(0, ast.If(ast.Constant(False), [ast.Import([ast.alias("_", n) for n in imported])], []))
        ast.copy_location(body[0], node)
    code = compile(ast.fix_missing_locations(ast.Module(body, [])), filename, "exec", flags=features,
                   dont_inherit=True)
    compiled = next(c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == name)
    if function.__code__.co_filename != filename or not _same_code(compiled, function.__code__):
        return (f"the source of {function_path(function)} on disk is not the code running (its file changed since "
                "it was imported, or its code was replaced)")
    return node


@functools.lru_cache(maxsize=16)
def _parsed_file(text: str, filename: str) -> ast.Module | str:
    """The tree of a file's text (a pure function of it: the same text, the same tree, never changed)."""
    if not text:
        return f"the source file {filename} cannot be read"
    try:
        return ast.parse(text, filename)
    except SyntaxError as exc:
        return f"{filename} no longer parses ({exc.msg}, line {exc.lineno}): it changed since it was imported"


def _last_binding(statements: list[ast.stmt], name: str) -> ast.stmt | None:
    """The last statement of a class or module body binding ``name`` (the binding its execution leaves), looking
    into ``if``/``try``/``with`` blocks but not into functions or classes."""
    found = None
    for statement in statements:
        if isinstance(statement, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and statement.name == name:
            found = statement
        elif isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Import, ast.ImportFrom)):
            targets = getattr(statement, "targets", None) or [getattr(statement, "target", None)]
            bound = {n.id for t in targets if t is not None for n in ast.walk(t) if isinstance(n, ast.Name)}
            bound |= {(a.asname or a.name).split(".")[0] for a in getattr(statement, "names", ())}
            found = statement if name in bound else found
        elif not isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            blocks = [getattr(statement, f, None) or [] for f in ("body", "orelse", "finalbody")]
            blocks += [handler.body for handler in getattr(statement, "handlers", ())]
            for block in blocks:
                if block and isinstance(block[0], ast.stmt):
                    found = _last_binding(block, name) or found
    return found


# ------------------------------------------------------------------------------------- compiling


def _built_from_source(definer: type, node: ast.FunctionDef) -> tuple[object, types.FunctionType] | str:
    """``(decorated, bare)``: the def ``node`` compiled and decorated as the class body did, and the function
    before its decorators; or why that fails."""
    try:
        bare = _compiled(definer, copy.deepcopy(node), None)
        return _decorated(bare, node.decorator_list, definer), bare
    except Exception as exc:  # the source's own code: whatever it raises, it is not the running function's
        return f"its source on disk does not build ({type(exc).__name__}: {exc})"[:300]


def _compiled(definer: type, node: ast.FunctionDef, helpers: types.ModuleType | None,
              bound: Mapping[str, object] | None = None) -> types.FunctionType:
    """``node`` without its decorators, compiled inside a class named as ``definer`` (so private names are mangled
    as in its body) in a factory taking ``HELPERS`` (and the names of ``bound``), with its file's future features,
    run against its module's globals (read live, never written: the factory is a local), under its file name and
    the file's positions. Zero-argument ``super()`` gets ``definer``, as in its body."""
    module = sys.modules[definer.__module__]
    filename = inspect.getsourcefile(module)
    tree = _parsed_file("".join(linecache.getlines(filename, module.__dict__)), filename)
    node = copy.copy(node)
    node.decorator_list = []
    holder = ast.ClassDef(_holder_name(definer, node), [], [], [node], [])
    bound = bound or {}
    factory = ast.FunctionDef("_hf_rmsnorm_factory", _arguments(HELPERS, *bound), [
        holder, ast.Return(ast.Attribute(ast.Name(holder.name, ast.Load()), node.name, ast.Load()))], [])
    body: list[ast.stmt] = [factory]
    # The compiler calls a module's attribute (``torch.arange(...)``) differently from an object's method when the
    # module was imported at the top of the file: the same names are declared imported here (never run), so the
    # bytecode is the original's.
    imported, features = _module_facts(tree) if not isinstance(tree, str) else ((), 0)
    if imported:
        body.insert(0, ast.If(ast.Constant(False), [ast.Import([ast.alias("_", name) for name in imported])], []))
    for new in body + [holder, factory.body[1]]:
        ast.copy_location(new, node)
    code = compile(ast.fix_missing_locations(ast.Module(body, [])), filename, "exec", flags=features,
                   dont_inherit=True)
    namespace: dict[str, object] = {}
    exec(code, module.__dict__, namespace)  # the imports are never run
    function = namespace["_hf_rmsnorm_factory"](helpers, *bound.values())
    cell = dict(zip(function.__code__.co_freevars, function.__closure__ or ())).get("__class__")
    if cell is not None:  # the class statement set it to the holder
        cell.cell_contents = definer
    function.__qualname__ = f"{definer.__qualname__}.{node.name}"
    return function


def _holder_name(definer: type, node: ast.FunctionDef) -> str:
    """A name for the class the def is compiled in that mangles private names as ``definer``'s does (mangling
    drops a class name's leading underscores) and that the def does not use: the factory binds it, and the def's
    own reads of ``definer``'s name must reach the module's class."""
    used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    name = "_" + definer.__name__.lstrip("_")
    while name in used or name == definer.__name__:
        name = "_" + name
    return name


def _arguments(*names: str) -> ast.arguments:
    return ast.arguments([], [ast.arg(name) for name in names], None, [], [], None, [])


def _decorated(function: types.FunctionType, decorators: list[ast.expr], definer: type) -> object:
    """``function`` decorated by the expressions ``decorators`` (innermost last, as written), each evaluated in
    ``definer``'s module globals under its own position."""
    module = sys.modules[definer.__module__]
    for decorator in reversed(decorators):
        expression = ast.fix_missing_locations(ast.Expression(decorator))
        compiled = compile(expression, inspect.getsourcefile(module), "eval", dont_inherit=True)
        function = eval(compiled, module.__dict__)(function)
    return function


@functools.lru_cache(maxsize=16)
def _module_facts(tree: ast.Module) -> tuple[tuple[str, ...], int]:
    """The names the top level of a module's tree binds by an import, and the compiler flags of its future
    features (the tree is ``_parsed_file``'s)."""
    names: dict[str, None] = {}
    features = 0
    statements = list(tree.body)
    while statements:
        statement = statements.pop()
        if isinstance(statement, ast.ImportFrom) and statement.module == "__future__":
            for alias in statement.names:
                features |= getattr(__future__, alias.name).compiler_flag
        elif isinstance(statement, (ast.Import, ast.ImportFrom)):
            names.update(dict.fromkeys((a.asname or a.name).split(".")[0] for a in statement.names if a.name != "*"))
        elif not isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for field in ("body", "orelse", "finalbody"):
                statements.extend(getattr(statement, field, None) or ())
            for handler in getattr(statement, "handlers", ()):
                statements.extend(handler.body)
    return tuple(sorted(names)), features


# ------------------------------------------------------------------------------------- comparing


class _Context:
    """What a comparison knows: the definer and its def (to name a decorator), the source's bare
    def, and, once met, the running function paired with it (``live_def``)."""

    def __init__(self, definer: type, node: ast.FunctionDef, bare: types.FunctionType) -> None:
        self.definer, self.node, self.bare = definer, node, bare
        self.live_def: types.FunctionType | None = None
        self.seen: set[tuple[int, int]] = set()

    def is_def(self, function: types.FunctionType) -> bool:
        """Whether ``function`` is the def's own function (the running one, or the source's compilation)."""
        code = function.__code__
        return function is self.bare or (code.co_qualname == f"{self.definer.__qualname__}.forward"
                                         and function.__globals__.get("__name__") == self.definer.__module__)


def _difference(running: object, built: object, context: _Context) -> _Difference | None:
    """The first difference between a running function and the source's compilation ``built``, outermost first:
    codes, then defaults, keyword defaults, closure values and wrapped functions (each function compared once)."""
    running = _without_checkpointing(running)
    if (id(running), id(built)) in context.seen:
        return None
    context.seen.add((id(running), id(built)))
    if not isinstance(running, types.FunctionType) or not isinstance(built, types.FunctionType):
        if type(running) is not type(built):
            return _Difference(True, f"{context.definer.__qualname__}.forward runs {function_path(running)} "
                                     f"where its source has {function_path(built)}")
        return None if _same_value(running, built, context) else _stale(context, "holds other values")
    if not _same_function_code(running, built):
        return _code_difference(running, built, context)
    if built is context.bare:
        context.live_def = running
    for what, a, b in (("defaults", running.__defaults__, built.__defaults__),
                       ("keyword defaults", running.__kwdefaults__, built.__kwdefaults__)):
        if not _same_value(a, b, context):
            return _stale(context, f"the running function's {what} are {a!r}, its source's {b!r}")
    running_cells, built_cells = _cells(running), _cells(built)
    for name, value in running_cells.items():
        if name == "__class__":
            continue
        if isinstance(value, types.FunctionType):
            difference = _difference(value, built_cells[name], context)
            if difference is not None:
                return difference
        elif not _same_value(value, built_cells[name], context):
            return _stale(context, f"{function_path(running)} holds {name}={value!r}, its source's "
                                   f"{built_cells[name]!r}")
    wrapped = getattr(running, "__wrapped__", None), getattr(built, "__wrapped__", None)
    if wrapped != (None, None):
        return _difference(*wrapped, context)
    return None


def _code_difference(running: types.FunctionType, built: types.FunctionType, context: _Context) -> _Difference:
    """Why two functions' codes differ: a wrapper the source does not apply (foreign), a decorator of the source
    the running function lacks, or the def's code itself (the file changed), or another function altogether."""
    inner_running = _without_checkpointing(getattr(running, "__wrapped__", None))
    inner_built = getattr(built, "__wrapped__", None)
    if isinstance(inner_running, types.FunctionType) and _same_function_code(inner_running, built):
        return _Difference(True, f"{context.definer.__qualname__}.forward is wrapped by {function_path(running)}, "
                                 f"which its source does not apply; {_ONLY_ITS_OWN} (patch before wrapping it)")
    if isinstance(inner_built, types.FunctionType) and _same_function_code(running, inner_built):
        return _stale(context, f"its source applies {_decorator_text(built, context)}, which the running function "
                               "lacks")
    if context.is_def(running) and context.is_def(built):
        return _stale(context, "its code differs from the code running")
    return _Difference(True, _foreign_text(context.definer, running))


def _decorator_text(built: types.FunctionType, context: _Context) -> str:
    """The decorator expression of the source that made ``built``, a level of the decorated chain: counted from
    the bare def when each decorator says what it wraps, else named by its function."""
    depth, inner = 0, built
    while inner is not context.bare and isinstance(inner, types.FunctionType):
        depth, inner = depth + 1, getattr(inner, "__wrapped__", None)
    decorators = context.node.decorator_list
    if inner is context.bare and 0 < depth <= len(decorators):
        return ast.unparse(decorators[len(decorators) - depth])
    return function_path(built)


def _stale(context: _Context, what: str) -> _Difference:
    return _Difference(False, f"the source of {context.definer.__qualname__}.forward on disk is not the code running: "
                              f"{what} (its file changed since it was imported)")


def _same_function_code(a: types.FunctionType, b: types.FunctionType) -> bool:
    return a.__code__ is b.__code__ or (a.__code__.co_filename == b.__code__.co_filename
                                        and _same_code(a.__code__, b.__code__))


def _same_value(a: object, b: object, context: _Context) -> bool:
    """Whether a value the running function holds is the one its source builds, as far as can be told: functions
    by ``_difference``, containers item by item, bound methods by function and object, values with an equality of
    their own by it, other objects by type and attributes (a decorator's fresh context manager)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, types.FunctionType):
        return _difference(a, b, context) is None
    if isinstance(a, types.MethodType):
        return a.__func__ is b.__func__ and _same_value(a.__self__, b.__self__, context)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same_value(x, y, context) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k], context) for k in a)
    if type(a).__eq__ is object.__eq__:
        return not hasattr(a, "__dict__") or _same_value(vars(a), vars(b), context)
    try:
        equal = a == b
    except Exception:  # an equality that cannot answer: nothing shows them different
        return True
    return equal if isinstance(equal, bool) else True


def _same_code(a: types.CodeType, b: types.CodeType) -> bool:
    """Whether two code objects run the same instructions on the same names and constants (nested functions
    alike), whatever their jump offsets, qualified names and positions."""
    if (a.co_names, a.co_varnames, a.co_freevars) != (b.co_names, b.co_varnames, b.co_freevars):
        return False
    ops_a, ops_b = list(dis.get_instructions(a)), list(dis.get_instructions(b))
    if len(ops_a) != len(ops_b):
        return False
    for x, y in zip(ops_a, ops_b):
        if x.opname != y.opname:
            return False
        if isinstance(x.argval, types.CodeType) and isinstance(y.argval, types.CodeType):
            if not _same_code(x.argval, y.argval):
                return False
        elif x.opcode not in dis.hasjrel + dis.hasjabs and x.argrepr != y.argrepr and not (
            isinstance(x.argval, str) and isinstance(y.argval, str) and ".<locals>." in x.argval + y.argval
        ):
            return False
    return True
