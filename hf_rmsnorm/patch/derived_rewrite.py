"""The derived forwards: a layer's or a stack's forward with the sites its analysis found rewritten into the
fused calls (``derived_sites.py`` and ``derived_loops.py`` say which, and why that is exact), compiled as its class
body compiled the original and decorated as it is (``derived_source.py``), calling ``derived_runtime``'s helpers.

Every node a rewrite creates carries the full location (lines and columns) of the code it stands for: a helper
call and its assignment the add's, the name that replaces a norm call that call's, a layer loop's parts the
loop's. So tracebacks, ``dis`` and the source annotations of ``torch.export`` name the add's own line.
"""

from __future__ import annotations

import ast
import copy
from collections.abc import Callable

from torch import Tensor

from . import derived_blocks, derived_runtime, derived_source, handoff
from .derived_blocks import DerivedBlockKind
from .derived_loops import StackLoop, stack_layout, stack_loops
from .derived_source import helper_call
from .derived_sites import (
    AfterPlan, ArgumentPlan, BeforePlan, DerivedLayerKind, GuardedPlan, OutputPlan, SublayerPlan, analysed,
    signature_problem,
)
from .derived_syntax import compares_reads, located, self_name

# The local a ``before`` rewrite keeps the normed sum in until its consumer ran (then deleted: it is freed as the
# original's temporary is).
_NORMED = "_hf_rmsnorm_normed_"
# The local a guarded site keeps its sum in before the view the original applies to it.
_SUM = "_hf_rmsnorm_sum_"
# The local a derived stack forward keeps what its last layer call handed on in (``handoff.call_layer``).
_HANDED = "_hf_rmsnorm_handed"


def fused_forward(base: type, kind: DerivedLayerKind) -> Callable[..., Tensor]:
    """``base.forward`` with ``kind.sites`` rewritten and its input norm reading what a previous layer hands on,
    taking the ``handoff.LayerCall`` as the keyword ``handoff.CALL_PARAM``; decorated as the original is.

    Raises:
        ValueError: the source cannot be derived from, or a site or the input norm of ``kind`` is not in it (any
            more).
    """
    forward = _class_forward(base)
    function = forward.node
    problem = signature_problem(function)
    if problem is not None:
        raise ValueError(f"cannot derive a fused forward for {base.__qualname__}: {problem}")
    analysis = analysed(forward, function, kind.norms, kind.sublayers)
    found_sites = {plan.site for plan in analysis.plans}
    missing = [site.label for site in kind.sites if site not in found_sites]
    if missing:
        raise ValueError(f"{base.__qualname__}.forward has no {', '.join(missing)}")
    found = analysis.input_norm.norm if analysis.input_norm is not None else None
    if kind.input_norm is not None and found != kind.input_norm:
        raise ValueError(f"{base.__qualname__}.forward no longer applies {kind.input_norm} to its input first")
    frees: list[tuple[list[ast.stmt], ast.stmt, str]] = []
    viewing: list[tuple[list[ast.stmt], ast.stmt, ast.stmt]] = []  # (block, statement, the one to insert after it)
    self_param = self_name(function)
    for plan in analysis.plans:  # a site copied into both branches of an ``if`` (derived_branches) has two plans
        if plan.site not in kind.sites:
            continue
        if isinstance(plan, BeforePlan):
            frees.append(_rewrite_before(plan))
        elif isinstance(plan, GuardedPlan):
            frees.append(_rewrite_guarded(plan, self_param, viewing))
        elif isinstance(plan, AfterPlan) and plan.next_call is not None:
            frees.append(_rewrite_chained_after(plan))
        elif isinstance(plan, AfterPlan):
            _rewrite_after(plan)
        elif isinstance(plan, SublayerPlan):
            freed = _rewrite_sublayer(plan, self_param)
            if freed is not None:
                frees.append(freed)
        elif isinstance(plan, ArgumentPlan):
            _replace(function, plan.call,
                     located(helper_call("norm_of_add", plan.call.func, plan.add.left, plan.add.right), plan.call))
        else:
            _rewrite_output(plan)
    for statements, anchor, inserted in viewing:  # after every rewrite by index: these insert statements
        statements.insert(next(k for k, s in enumerate(statements) if s is anchor) + 1, inserted)
    for statements, consumer, normed in frees:
        if not isinstance(consumer, ast.Return):
            position = next(k for k, s in enumerate(statements) if s is consumer)
            statements.insert(position + 1, located(ast.Delete([ast.Name(normed, ast.Del())]), consumer))
    if kind.input_norm is not None:
        for call in analysis.input_norm.calls:
            _replace(function, call, located(_handed_norm_call("input_norm", handoff.CALL_PARAM, call), call))
    analysis.inlining.guard()  # after every rewrite: the guards take the rewritten statements
    function.args.kwonlyargs.append(located(ast.arg(handoff.CALL_PARAM), function))
    function.args.kw_defaults.append(located(ast.Constant(None), function))
    return derived_source.compile_forward(forward, function, derived_runtime, analysis.inlining.bound)


def _rewrite_before(plan: BeforePlan) -> tuple[list[ast.stmt], ast.stmt, str]:
    """``s = a + b`` -> ``normed, s = norm_of_sum(F, a, b)``, and ``F(s)`` in the consumer -> ``normed``; returns
    what to free after the consumer."""
    value = helper_call("norm_of_sum", plan.call.func, plan.add.left, plan.add.right)
    return _bind_normed_sum(plan.statements, plan.index, plan.add, plan.total, value, plan.consumer, plan.call)


def _rewrite_guarded(plan: GuardedPlan, self_name_: str,
                     viewing: list[tuple[list[ast.stmt], ast.stmt, ast.stmt]]) -> tuple[list[ast.stmt], ast.stmt, str]:
    """``s = a + b`` -> ``pending, s = norm_of_sum_first(a, b, self, 0 if T0 else 1 if T1 else None, paths)``
    (``paths`` the norms' attribute paths, in the tests' order; an output's takes the ``LayerCall`` too), and each
    ``F(v)`` under the test ``Tk`` -> ``take_normed(pending, k, F, v)``; returns what to free after the last
    ``if``. ``s = (a + b).view(...)`` binds the sum to a local of its own first, then views it (an output's view
    through ``viewed_output``)::

        pending, total = norm_of_sum_first(a, b, self, ...); s = viewed_output(call, total, total.view(...))
    """
    add = plan.add
    pending = f"{_NORMED}{add.lineno}_{add.col_offset}"
    chosen: ast.expr = ast.Constant(None)
    for k in reversed(range(len(plan.consumers))):  # evaluated as the ifs are: a test only when the earlier failed
        chosen = ast.IfExp(copy.deepcopy(plan.consumers[k].test), ast.Constant(k), chosen)
    paths = ast.Tuple([ast.Tuple([ast.Constant(step) for step in path], ast.Load()) for path in plan.site.norms],
                      ast.Load())
    output = plan.site.position == "output"
    call_param = ast.Name(handoff.CALL_PARAM, ast.Load())
    value = helper_call("norm_of_sum_first", add.left, add.right, ast.Name(self_name_, ast.Load()), chosen, paths,
                         *([call_param] if output else []))
    total = plan.total if plan.view is None else f"{_SUM}{add.lineno}_{add.col_offset}"
    targets = ast.Tuple([ast.Name(pending, ast.Store()), ast.Name(total, ast.Store())], ast.Store())
    plan.statements[plan.index] = located(ast.Assign([targets], value), add)
    if plan.view is not None:  # inserted after every rewrite by index (``viewing``)
        plan.view.func.value = ast.Name(total, ast.Load())
        viewed = helper_call("viewed_output", call_param, ast.Name(total, ast.Load()), plan.view) if output else (
            plan.view)
        viewing.append((plan.statements, plan.statements[plan.index],
                        located(ast.Assign([ast.Name(plan.total, ast.Store())], viewed), add)))
    for k, (consumer, call) in enumerate(zip(plan.consumers, plan.calls)):
        taken = helper_call("take_normed", ast.Name(pending, ast.Load()), ast.Constant(k), call.func, call.args[0])
        _replace(consumer, call, located(taken, call))
    return plan.statements, plan.consumers[-1], pending


def _rewrite_after(plan: AfterPlan) -> None:
    """``s = r + F(e)`` (or ``return ...``) -> ``s = norm_then_add(F, e, r)``; ``y = F(e)`` -> ``pass``."""
    value = helper_call("norm_then_add", plan.call.func, plan.call.args[0], plan.residual)
    statement = ast.Return(value) if plan.total is None else ast.Assign([ast.Name(plan.total, ast.Store())], value)
    plan.statements[plan.index] = located(statement, plan.add)
    _drop_norm_binding(plan)


def _rewrite_chained_after(plan: AfterPlan) -> tuple[list[ast.stmt], ast.stmt, str]:
    """``s = r + F(e)`` -> ``normed, s = norm_add_norm(F, e, r, F2)``, ``y = F(e)`` -> ``pass`` and ``F2(s)`` in
    the consumer -> ``normed``; returns what to free after the consumer (as ``_rewrite_before``)."""
    _drop_norm_binding(plan)
    value = helper_call("norm_add_norm", plan.call.func, plan.call.args[0], plan.residual, plan.next_call.func)
    return _bind_normed_sum(plan.statements, plan.index, plan.add, plan.total, value, plan.consumer, plan.next_call)


def _bind_normed_sum(statements: list[ast.stmt], index: int, add: ast.BinOp, total: str, value: ast.expr,
                     consumer: ast.stmt, call: ast.Call) -> tuple[list[ast.stmt], ast.stmt, str]:
    """``statements[index]`` (the add's) -> ``normed, total = value``, and the norm's ``call`` in ``consumer`` ->
    ``normed``; returns what to free after the consumer."""
    normed = f"{_NORMED}{add.lineno}_{add.col_offset}"
    targets = ast.Tuple([ast.Name(normed, ast.Store()), ast.Name(total, ast.Store())], ast.Store())
    statements[index] = located(ast.Assign([targets], value), add)
    _replace(consumer, call, located(ast.Name(normed, ast.Load()), call))
    return statements, consumer, normed


def _drop_norm_binding(plan: AfterPlan) -> None:
    # ``y = F(e)`` of the two-statement form -> ``pass``: the helper calls the norm.
    if plan.dropped is not None:
        plan.statements[plan.dropped] = located(ast.Pass(), plan.statements[plan.dropped])


def _rewrite_sublayer(plan: SublayerPlan, self_name_: str) -> tuple[list[ast.stmt], ast.stmt, str] | None:
    """``T = self.<path>(args)`` -> ``T, handed = sublayer_into(self, self.<path>, args)`` and ``F(s)`` in the
    consumer -> ``take_handed(handed, F, s)`` (returns what to free after the consumer); for the layer's output,
    ``T = sublayer_output(call, self, self.<path>, args)``."""
    statement, call = plan.statements[plan.index], plan.call
    layer = ast.Name(self_name_, ast.Load())
    if plan.consumer is None:
        helper = helper_call("sublayer_output", ast.Name(handoff.CALL_PARAM, ast.Load()), layer, call.func,
                              *call.args)
        helper.keywords = call.keywords
        statement.value = located(helper, call)
        return None
    handed = f"{_NORMED}{call.lineno}_{call.col_offset}"
    helper = helper_call("sublayer_into", layer, call.func, *call.args)
    helper.keywords = call.keywords
    targets = ast.Tuple([statement.targets[0], ast.Name(handed, ast.Store())], ast.Store())
    plan.statements[plan.index] = located(ast.Assign([targets], located(helper, call)), statement)
    taken = helper_call("take_handed", ast.Name(handed, ast.Load()), plan.norm_call.func, plan.norm_call.args[0])
    _replace(plan.consumer, plan.norm_call, located(taken, plan.norm_call))
    return plan.statements, plan.consumer, handed


def _rewrite_output(plan: OutputPlan) -> None:
    """``a + b`` -> ``stream_sum(call, a, b)``, where the layer returns it; each branch between the add and the
    ``return`` begins with ``withdraw(call)``."""
    add = plan.add
    plan.statement.value = located(
        helper_call("stream_sum", ast.Name(handoff.CALL_PARAM, ast.Load()), add.left, add.right), add)
    for branch in plan.withdrawn:
        branch.insert(0, located(ast.Expr(helper_call("withdraw", ast.Name(handoff.CALL_PARAM, ast.Load()))),
                                 branch[0]))


def fused_stack_forward(base: type, layers: str, final_norm: str | None) -> Callable[..., object]:
    """``base.forward`` (a forward of ``derived_loops``' form running ``self.<layers>`` then
    ``self.<final_norm>``) with each loop over the layers calling ``handoff.call_layer`` and the final norm
    reading what the last layer hands on (``handoff.py``); decorated as the original is::

        for layer in self.layers[...]:
            h = layer(h, ...)
        h = self.norm(h)

    becomes::

        _hf_rmsnorm_handed = None
        for layer, _hf_rmsnorm_next_<line> in _hf_rmsnorm_derived.layers_with_next(self.layers[...]):
            h, _hf_rmsnorm_handed = _hf_rmsnorm_derived.call_layer(
                self, layer, _hf_rmsnorm_next_<line>, True, _hf_rmsnorm_handed, h, ...)
        h = _hf_rmsnorm_derived.final_norm(_hf_rmsnorm_handed, self.norm, h, h)

    (``True``: the loop's output goes to the final norm; a loop whose output is copied out says False, so its last
    layer hands nothing on). What is handed on is reset before every loop and read only by the module it was made
    for.

    Raises:
        ValueError: the source cannot be derived from, or its loops are not of that form (any more).
    """
    forward = _class_forward(base)
    function = forward.node
    loops = stack_loops(forward, function)
    if stack_layout(loops) != (layers, final_norm):
        raise ValueError(f"{base.__qualname__}.forward does not run self.{layers} then "
                         f"{'no final norm' if final_norm is None else f'self.{final_norm}'} as read when patching")
    final_calls: dict[int, ast.Call] = {}
    for loop in loops:
        feeds_final_norm = final_norm is not None and loop.final_norm == final_norm
        _rewrite_loop(loop, self_name(function), feeds_final_norm)
        if feeds_final_norm:
            final_calls.update((id(call), call) for call in loop.final.calls)
    for call in final_calls.values():
        _replace(function, call, located(_handed_norm_call("final_norm", _HANDED, call), call))
    body = function.body
    has_docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    body.insert(int(has_docstring), located(_handed_reset(), body[int(has_docstring)]))
    return derived_source.compile_forward(forward, function, derived_runtime)


def _rewrite_loop(loop: StackLoop, self_name_: str, feeds_final_norm: bool) -> None:
    """``fused_stack_forward``'s rewrite of one loop: iterated with the next layer, its layer called through
    ``call_layer``, what is handed on reset before it."""
    following = f"_hf_rmsnorm_next_{loop.loop.lineno}"
    statement = loop.loop
    if isinstance(statement.iter, ast.Call):  # enumerate(self.<layers>[...]): (i, layer)
        iterated, target = statement.iter.args[0], statement.target.elts[1]
        statement.iter.args[0] = located(helper_call("layers_with_next", iterated), iterated)
        statement.target.elts[1] = located(ast.Tuple([target, ast.Name(following, ast.Store())], ast.Store()), target)
    else:
        iterated, target = statement.iter, statement.target
        statement.iter = located(helper_call("layers_with_next", iterated), iterated)
        statement.target = located(ast.Tuple([target, ast.Name(following, ast.Store())], ast.Store()), target)
    call = loop.call.value
    loop.call.value = located(helper_call(
        "call_layer", ast.Name(self_name_, ast.Load()), call.func, ast.Name(following, ast.Load()),
        ast.Constant(feeds_final_norm), ast.Name(_HANDED, ast.Load()), *call.args), call)
    loop.call.value.keywords = call.keywords
    target = loop.call.targets[0]
    loop.call.targets = [located(ast.Tuple([target, ast.Name(_HANDED, ast.Store())], ast.Store()), target)]
    loop.block.insert(next(i for i, s in enumerate(loop.block) if s is statement), located(_handed_reset(), statement))


def fused_block_forward(base: type, kind: DerivedBlockKind) -> Callable[..., object]:
    """``base.forward`` (a block forward of ``derived_blocks``' form) with each sublayer call made through
    ``handoff.call_sublayer``, taking the ``handoff.LayerCall`` as the keyword ``handoff.CALL_PARAM``; decorated as
    the original is::

        h, a = self.layer[0](h, m)
        if h.dtype == torch.float16:
            h = clamp(h)
        h = self.layer[-1](h)
        return h, a

    becomes::

        _hf_rmsnorm_handed = _hf_rmsnorm_derived.block_input(self, _hf_rmsnorm_call)
        (h, a), _hf_rmsnorm_handed = _hf_rmsnorm_derived.call_sublayer(
            self, _hf_rmsnorm_call, _hf_rmsnorm_handed, 0, self.layer[0], h, m)
        if h.dtype == torch.float16:
            _hf_rmsnorm_handed = None
            h = clamp(h)
        h, _hf_rmsnorm_handed = _hf_rmsnorm_derived.call_sublayer(
            self, _hf_rmsnorm_call, _hf_rmsnorm_handed, 1, self.layer[-1], h)
        return h, a

    (the ``if`` after the last call withdraws the block's handoff instead: ``withdraw(_hf_rmsnorm_call)``).

    Raises:
        ValueError: the source cannot be derived from, or its sublayer calls are not ``kind``'s (any more).
    """
    forward = _class_forward(base)
    function = forward.node
    code = derived_blocks.block_code(base)
    if code is None or code.problem is not None or code.sites != kind.sites:
        raise ValueError(f"{base.__qualname__}.forward no longer calls {', '.join(s.text for s in kind.sites)} "
                         "in the form read when patching")
    call_param = ast.Name(handoff.CALL_PARAM, ast.Load())
    for statement, after_last in derived_blocks.resets(function, code):
        # After the last call the block withdraws what it hands on; before, what a sublayer handed on is dropped.
        def reset() -> ast.stmt:
            return ast.Expr(helper_call("withdraw", call_param)) if after_last else _handed_reset()

        if compares_reads(statement.test):
            branches = (statement.body, statement.orelse)
        else:  # ``A and B``: dropped once the comparison ``A`` is true, before ``B`` runs (an expression: True)
            dropping = reset().value
            if not after_last:
                dropping = ast.NamedExpr(ast.Name(_HANDED, ast.Store()), dropping)
            first = statement.test.values[0]
            statement.test.values.insert(1, located(ast.Compare(dropping, [ast.Is()], [ast.Constant(None)]), first))
            branches = (statement.orelse,)
        for branch in branches:
            if branch:
                branch.insert(0, located(reset(), branch[0]))
    for index, statement in enumerate(derived_blocks.site_calls(function)):
        call = statement.value
        statement.value = located(helper_call(
            "call_sublayer", ast.Name(self_name(function), ast.Load()), call_param, ast.Name(_HANDED, ast.Load()),
            ast.Constant(index), call.func, *call.args), call)
        statement.value.keywords = call.keywords
        target = statement.targets[0]
        statement.targets = [located(ast.Tuple([target, ast.Name(_HANDED, ast.Store())], ast.Store()), target)]
    body = function.body
    has_docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    entry = ast.Assign([ast.Name(_HANDED, ast.Store())],
                       helper_call("block_input", ast.Name(self_name(function), ast.Load()), call_param))
    body.insert(int(has_docstring), located(entry, body[int(has_docstring)]))
    function.args.kwonlyargs.append(located(ast.arg(handoff.CALL_PARAM), function))
    function.args.kw_defaults.append(located(ast.Constant(None), function))
    return derived_source.compile_forward(forward, function, derived_runtime)


def _handed_reset() -> ast.Assign:
    return ast.Assign([ast.Name(_HANDED, ast.Store())], ast.Constant(None))


def _handed_norm_call(helper: str, handed: str, call: ast.Call) -> ast.Call:
    """``_hf_rmsnorm_derived.<helper>(<handed>, self.<norm>, x, x)`` for the norm call ``self.<norm>(x)`` (or
    ``self.<norm>(x.to(...))``, then its third argument is that)."""
    argument = call.args[0]
    read = argument.func.value if isinstance(argument, ast.Call) else argument
    return helper_call(helper, ast.Name(handed, ast.Load()), call.func, argument, ast.Name(read.id, ast.Load()))


def _class_forward(base: type) -> derived_source.ClassForward:
    forward = derived_source.class_forward(base)
    if isinstance(forward, str):
        raise ValueError(f"cannot derive a fused forward for {base.__qualname__}: {forward}")
    return forward


def _replace(tree: ast.AST, old: ast.AST, new: ast.AST) -> None:
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, field, new)
            elif isinstance(value, list):
                for k, item in enumerate(value):
                    if item is old:
                        value[k] = new
