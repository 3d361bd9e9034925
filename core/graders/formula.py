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
    "min": min, "max": max, "abs": abs, "floor": math.floor, "ceil": math.ceil, "round": round,
    "exp": math.exp, "sqrt": math.sqrt, "log": math.log,
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
    for node in nodes:
        _check(node, names)
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
        return
    raise FormulaError(f"calculate_output may not contain {type(node).__name__}: only arithmetic over grader "
                       "names")


def evaluate(tree: ast.Expression, scores: Mapping[str, float]) -> float:
    """The formula's value for these scores; ArithmeticError or ValueError when the arithmetic fails."""
    value = float(_value(tree.body, scores))
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
