"""Small readers of Python syntax that the analyses of a forward share (``derived_sites.py``,
``derived_loops.py``): attribute paths of ``self``, module calls, sums, name reads, and the facts their soundness
checks need: what is evaluated before an expression, and whether it runs later, conditionally or not at all."""

from __future__ import annotations

import ast

COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
# Nodes whose body is another scope: code there runs when the scope is called or iterated, not where it is written.
NESTED_SCOPES = (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, *COMPREHENSIONS)


def self_name(function: ast.FunctionDef) -> str:
    return function.args.args[0].arg


def item_path(node: ast.expr, self_name: str) -> tuple[str | int, ...] | None:
    """``("a", "b")`` for ``self.a.b``, ``("a", 0)`` for ``self.a[0]``, ``("a", -1)`` for ``self.a[-1]`` (integer
    items, negative ones too), None for anything else."""
    path: list[str | int] = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            path.append(node.attr)
        else:
            index = node.slice
            if isinstance(index, ast.UnaryOp) and isinstance(index.op, ast.USub):
                index = ast.Constant(-index.operand.value) if isinstance(index.operand, ast.Constant) else None
            if not (isinstance(index, ast.Constant) and type(index.value) is int):
                return None
            path.append(index.value)
        node = node.value
    if isinstance(node, ast.Name) and node.id == self_name and path:
        return tuple(reversed(path))
    return None


def attribute_path(node: ast.expr, self_name: str) -> tuple[str, ...] | None:
    """``("a", "b")`` for ``self.a.b``, ``("a", "0")`` for ``self.a[0]`` (a ``ModuleList`` item, which ``getattr``
    finds by that name), None for anything else (a negative item too: ``getattr`` finds none)."""
    path = item_path(node, self_name)
    if path is None or any(type(step) is int and step < 0 for step in path):
        return None
    return tuple(str(step) for step in path)


def attribute_at(root: object, path: tuple[str, ...]) -> object:
    """What ``root.a.b`` holds at run time for the path ``("a", "b")`` (as ``attribute_path`` reads it), None where
    the path ends early."""
    for step in path:
        root = getattr(root, step, None)
    return root


def module_call(node: ast.AST, self_name: str) -> tuple[str, ...] | None:
    """The attribute path of ``self.a.b(x)`` (one positional argument, no keywords), None for anything else."""
    if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords and not isinstance(
        node.args[0], ast.Starred
    ):
        return attribute_path(node.func, self_name)
    return None


def assigned_name(statement: ast.stmt) -> str | None:
    """``x`` for ``x = <value>``."""
    if isinstance(statement, ast.Assign) and len(statement.targets) == 1 and isinstance(statement.targets[0], ast.Name):
        return statement.targets[0].id
    return None


def summed(statement: ast.stmt) -> tuple[str, ast.BinOp] | None:
    """``(s, a + b)`` for ``s = a + b``."""
    name = assigned_name(statement)
    if name is not None and isinstance(statement.value, ast.BinOp) and isinstance(statement.value.op, ast.Add):
        return name, statement.value
    return None


def viewed_sum(statement: ast.stmt) -> tuple[str, ast.BinOp, ast.Call | None] | None:
    """``(s, a + b, None)`` for ``s = a + b``; ``(s, a + b, v)`` for ``s = (a + b).view(...)`` or ``.reshape(...)``
    (``v`` that call) whose arguments only read (``reads_only``)."""
    found = summed(statement)
    if found is not None:
        return (*found, None)
    name = assigned_name(statement)
    call = statement.value if name is not None else None
    if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr in ("view", "reshape")
            and isinstance(call.func.value, ast.BinOp) and isinstance(call.func.value.op, ast.Add)
            and not call.keywords and all(reads_only(a) for a in call.args)):
        return name, call.func.value, call
    return None


def statement_blocks(statement: ast.stmt) -> list[list[ast.stmt]]:
    """The statement lists nested in ``statement`` in source order: the bodies, ``else`` and ``finally`` blocks and
    handlers of an ``if``, a loop, a ``with`` or a ``try``; none for a nested function or class (another scope)."""
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return []
    blocks = [getattr(statement, name, None) for name in ("body", "orelse", "finalbody")]
    blocks += [handler.body for handler in getattr(statement, "handlers", ())]
    return [block for block in blocks if isinstance(block, list) and block and isinstance(block[0], ast.stmt)]


def past_aliases(statements: list[ast.stmt], j: int, names: set[str]) -> int:
    """The index of the first statement from ``j`` on that is no alias ``r = s`` of one of ``names`` (which gains
    the aliases)."""
    while j < len(statements) and (alias := assigned_name(statements[j])) and (
        isinstance(statements[j].value, ast.Name) and statements[j].value.id in names
    ):
        names.add(alias)
        j += 1
    return j


def returned_sum(statement: ast.stmt | None) -> ast.BinOp | None:
    """``a + b`` for ``return a + b``."""
    if isinstance(statement, ast.Return) and isinstance(statement.value, ast.BinOp) and isinstance(
        statement.value.op, ast.Add
    ):
        return statement.value
    return None


def loads(node: ast.AST, names: set[str] | None) -> list[ast.Name]:
    """The reads of ``names`` (of every name when None) in ``node``, nested scopes included."""
    return [n for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
            and (names is None or n.id in names)]


def named(node: ast.AST, name: str) -> list[ast.Name]:
    """Every occurrence of ``name`` in ``node`` (read, bound or deleted), nested scopes included."""
    return [n for n in ast.walk(node) if isinstance(n, ast.Name) and n.id == name]


def walrus_targets(node: ast.AST) -> set[str]:
    """The names ``:=`` binds in ``node``."""
    return {n.target.id for n in ast.walk(node) if isinstance(n, ast.NamedExpr)}


def parents(root: ast.AST) -> dict[int, ast.AST]:
    """Each node's parent in ``root``, by the node's id."""
    return {id(child): node for node in ast.walk(root) for child in ast.iter_child_nodes(node)}


def deferred_by(node: ast.AST, statement: ast.stmt, up: dict[int, ast.AST]) -> str | None:
    """What in ``statement`` makes ``node`` run elsewhere than where it is written, if anything: a nested scope
    (``NESTED_SCOPES``: later, or any number of times)."""
    while node is not statement:
        parent = up[id(node)]
        if isinstance(parent, NESTED_SCOPES):
            return {ast.Lambda: "a lambda", ast.GeneratorExp: "a generator expression"}.get(
                type(parent), "a comprehension" if isinstance(parent, (ast.ListComp, ast.SetComp, ast.DictComp))
                else "a nested function or class")
        node = parent
    return None


def conditional_in(node: ast.AST, statement: ast.stmt, up: dict[int, ast.AST]) -> str | None:
    """What in ``statement`` may skip ``node``, if anything: a branch of ``x if c else y``, a later operand of
    ``and``/``or``."""
    while node is not statement:
        parent = up[id(node)]
        if isinstance(parent, ast.IfExp) and node is not parent.test:
            return "a conditional expression"
        if isinstance(parent, ast.BoolOp) and node is not parent.values[0]:
            return f"the later operand of {'and' if isinstance(parent.op, ast.And) else 'or'}"
        node = parent
    return None


def evaluated_before(statement: ast.stmt, target: ast.AST) -> list[ast.expr]:
    """The subexpressions of ``statement`` that Python evaluates completely before it starts evaluating
    ``target`` (a node of its value, not of a nested scope), outermost first."""
    before: list[ast.expr] = []
    value = getattr(statement, "value", None)  # an assignment evaluates its value before its targets
    if value is not None:
        _before(value, target, before)
    return before


def _before(node: ast.AST, target: ast.AST, before: list[ast.expr]) -> bool:
    """Appends to ``before`` the parts of ``node`` evaluated before ``target``; whether ``target`` is in it."""
    if node is target:
        return True
    for child in _evaluation_order(node):
        if _before(child, target, before):
            return True
        before.append(child)
    return False


def _evaluation_order(node: ast.AST) -> list[ast.expr]:
    """The expressions directly inside ``node`` in the order Python evaluates them (a lambda's body and a
    comprehension's element run later: only their evaluated parts count)."""
    if isinstance(node, ast.Call):
        # Positional and keyword arguments in the order written (``f(k=g(), *h())`` is written so rarely that the
        # source order, which puts nothing later than CPython does, is taken).
        arguments = sorted([*node.args, *(k.value for k in node.keywords)], key=lambda n: (n.lineno, n.col_offset))
        return [node.func, *arguments]
    if isinstance(node, ast.Dict):
        return [part for key, value in zip(node.keys, node.values) for part in (key, value) if part is not None]
    if isinstance(node, ast.NamedExpr):
        return [node.value]
    if isinstance(node, ast.Lambda):
        return [d for d in (*node.args.defaults, *node.args.kw_defaults) if d is not None]
    if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
        return [node.generators[0].iter]
    return [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.expr)]


def reads_only(node: ast.expr) -> bool:
    """Whether evaluating ``node`` only reads: names, constants, and attributes and items of what it reads (no
    call, operator or assignment expression, which run code)."""
    if isinstance(node, (ast.Name, ast.Constant)):
        return True
    if isinstance(node, (ast.Attribute, ast.Starred)):
        return reads_only(node.value)
    if isinstance(node, ast.Subscript):
        return reads_only(node.value) and reads_only(node.slice)
    if isinstance(node, (ast.Tuple, ast.List)):
        return all(reads_only(e) for e in node.elts)
    if isinstance(node, ast.Slice):
        return all(part is None or reads_only(part) for part in (node.lower, node.upper, node.step))
    return False


def compares_reads(test: ast.expr) -> bool:
    """Whether ``test`` only reads (``reads_only``) and compares what it reads by ``==``, ``!=``, ``is`` or ``is
    not``, under ``not``, ``and`` and ``or`` (``hidden_states.dtype == torch.float16``): comparisons of values such
    as dtypes, numbers and ``None``, which call no code of the model."""
    if isinstance(test, ast.BoolOp):
        return all(compares_reads(value) for value in test.values)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return compares_reads(test.operand)
    return isinstance(test, ast.Compare) and all(
        isinstance(op, (ast.Eq, ast.NotEq, ast.Is, ast.IsNot)) for op in test.ops
    ) and all(reads_only(operand) for operand in (test.left, *test.comparators))


def tests_reads(test: ast.expr) -> bool:
    """Whether ``test`` is ``compares_reads``' or the truth of a value it only reads (``reads_only``: OPT's
    ``self.do_layer_norm_before``), under ``not``, ``and`` and ``or``: a flag, a number or None tested, which calls
    no code of the model, as a comparison of such values does not."""
    if isinstance(test, ast.BoolOp):
        return all(tests_reads(value) for value in test.values)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return tests_reads(test.operand)
    return compares_reads(test) or (reads_only(test) and not isinstance(test, (ast.Tuple, ast.List, ast.Starred)))


def flattened(statement: ast.stmt, names: set[str]) -> str | None:
    """``v`` for ``v = s.reshape(-1, s.size(-1))`` or ``v = s.view(-1, s.size(-1))`` (``s.shape[-1]`` alike),
    ``s`` one of ``names``: the rows of ``s`` as a matrix, in their order."""
    target = assigned_name(statement)
    call = statement.value if target is not None else None
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and call.func.attr in ("reshape", "view") and isinstance(call.func.value, ast.Name)
            and call.func.value.id in names and not call.keywords and len(call.args) == 2
            and _is_minus_one(call.args[0])):
        return None
    source, width = call.func.value.id, call.args[1]
    if isinstance(width, ast.Call) and len(width.args) == 1 and not width.keywords:  # s.size(-1)
        of, index = width.func, width.args[0]
        width_of = of.value if isinstance(of, ast.Attribute) and of.attr == "size" else None
    elif isinstance(width, ast.Subscript):  # s.shape[-1]
        of, index = width.value, width.slice
        width_of = of.value if isinstance(of, ast.Attribute) and of.attr == "shape" else None
    else:
        return None
    same = isinstance(width_of, ast.Name) and width_of.id == source
    return target if same and _is_minus_one(index) else None


def shape_read(statement: ast.stmt, names: set[str]) -> str | None:
    """``n`` for ``n = s.shape`` or ``n = s.size()``, ``s`` one of ``names`` (its sizes, read)."""
    target = assigned_name(statement)
    value = statement.value if target is not None else None
    if isinstance(value, ast.Call) and not value.args and not value.keywords:
        value = value.func if isinstance(value.func, ast.Attribute) and value.func.attr == "size" else None
    elif not (isinstance(value, ast.Attribute) and value.attr == "shape"):
        value = None
    return target if value is not None and isinstance(value.value, ast.Name) and value.value.id in names else None


def _is_minus_one(node: ast.expr) -> bool:
    return (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant)
            and type(node.operand.value) is int and node.operand.value == 1)


def located(node: ast.AST, where: ast.AST) -> ast.AST:
    """``node`` with every node of it that has no position given ``where``'s full position (line and column
    span): a rewrite's new nodes carry the location of what they replace, so tracebacks, ``dis`` and export
    annotations name its line."""
    for part in ast.walk(node):
        if "lineno" in part._attributes and getattr(part, "lineno", None) is None:
            part.lineno, part.col_offset = where.lineno, where.col_offset
            part.end_lineno, part.end_col_offset = where.end_lineno, where.end_col_offset
    return node
