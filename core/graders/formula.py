"""`multi` graders' `calculate_output`: arithmetic over named grader scores, parsed with `ast`, never eval'd.

Allowed: numbers, grader names, + - * / % and ** (`^` is power too, as OpenAI writes it), unary minus, parentheses,
and the functions min, max, abs, floor, ceil, round, exp, sqrt, log. Anything else is refused when the grader is
validated, so a running formula can only fail on arithmetic (a division by zero, an overflow).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Mapping

MAX_NODES = 200
BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.Mod: operator.mod, ast.Pow: math.pow,
}
UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
FUNCTIONS: dict[str, Callable[..., float]] = {
    "min": min, "max": max, "abs": abs, "floor": math.floor, "ceil": math.ceil,
    "round": lambda x, digits=0: round(x, int(digits)), "exp": math.exp, "sqrt": math.sqrt, "log": math.log,
}
# How many arguments each function takes (least, most; None: any number): min(a) of one number is not a list.
ARITY: dict[str, tuple[int, int | None]] = {
    "min": (2, None), "max": (2, None), "abs": (1, 1), "floor": (1, 1), "ceil": (1, 1), "round": (1, 2),
    "exp": (1, 1), "sqrt": (1, 1), "log": (1, 2),
}


class FormulaError(ValueError):
    """A formula that cannot be parsed, or that names what it may not."""


def parse_formula(text: str, *, names: set[str]) -> ast.Expression:
    """Parse and check a formula; FormulaError says what is refused."""
    try:
        # `^` is power with power's precedence (Python's xor binds looser than +); a formula holds no strings.
        tree = ast.parse(text.replace("^", "**"), mode="eval")
    except SyntaxError as exc:
        raise FormulaError(f"calculate_output does not parse: {exc.msg}") from exc
    except (RecursionError, MemoryError) as exc:  # e.g. thousands of unary minus signs in a row
        raise FormulaError("calculate_output is nested too deeply") from exc
    nodes = list(ast.walk(tree))
    if len(nodes) > MAX_NODES:
        raise FormulaError(f"calculate_output is longer than {MAX_NODES} terms")
    called = {id(node.func) for node in nodes if isinstance(node, ast.Call)}
    for node in nodes:
        _check(node, names)
        if isinstance(node, ast.Name) and node.id in FUNCTIONS and node.id not in names and id(node) not in called:
            raise FormulaError(f"calculate_output uses the function {node.id!r} as a value; call it, "
                               f"e.g. {node.id}(...)")
    return tree


def _check(node: ast.AST, names: set[str]) -> None:
    if isinstance(node, (ast.Expression, ast.Load, *BINARY, *UNARY)):
        return
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY or isinstance(node, ast.UnaryOp) \
            and type(node.op) in UNARY:
        return
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return
    if isinstance(node, ast.Name):
        if node.id not in names and node.id not in FUNCTIONS:
            raise FormulaError(f"calculate_output names {node.id!r}, which is not a grader; graders are "
                               f"{', '.join(sorted(names))}")
        return
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS or node.keywords \
                or not node.args:
            raise FormulaError(f"calculate_output may call only {', '.join(FUNCTIONS)} (positional arguments)")
        least, most = ARITY[node.func.id]
        if len(node.args) < least or most is not None and len(node.args) > most:
            wanted = f"{least}" if least == most else f"at least {least}" if most is None else f"{least} or {most}"
            raise FormulaError(f"calculate_output calls {node.func.id} with {len(node.args)} argument(s); it takes "
                               f"{wanted}")
        return
    raise FormulaError(f"calculate_output may not contain {type(node).__name__}: only arithmetic over grader "
                       "names")


def evaluate(tree: ast.Expression, scores: Mapping[str, float]) -> float:
    """The formula's value for these scores; ArithmeticError or ValueError when the arithmetic fails (whatever the
    functions raise on values they refuse counts as that: a checked formula is never a server error)."""
    try:
        value = float(_value(tree.body, scores))
    except (TypeError, KeyError, RecursionError) as exc:
        raise ValueError(f"calculate_output could not be computed: {exc}") from exc
    if not math.isfinite(value):
        raise ArithmeticError("calculate_output is not a finite number")
    return value


def _value(node: ast.expr, scores: Mapping[str, float]) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return float(node.value)
    if isinstance(node, ast.Name):
        return float(scores[node.id])
    if isinstance(node, ast.UnaryOp):
        return UNARY[type(node.op)](_value(node.operand, scores))
    if isinstance(node, ast.BinOp):
        return BINARY[type(node.op)](_value(node.left, scores), _value(node.right, scores))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return float(FUNCTIONS[node.func.id](*(_value(arg, scores) for arg in node.args)))
    raise FormulaError(f"calculate_output may not contain {type(node).__name__}")
