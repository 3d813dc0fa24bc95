"""GSM8K with a calculator tool: the tool, and the converter that writes rows offering it.

    python examples/gsm8k_tools.py --input gsm8k/train.jsonl --output data/gsm8k_tools/train.parquet
    torchrun --nproc-per-node 8 train_grpo.py --config configs/qwen2.5_0.5b_gsm8k_grpo_tools.yaml

Each row names the tool in ``extra_info.tools_kwargs`` (verl's multi-turn layout), so the chat template shows the
model the calculator's schema; the strict GSM8K scorer judges the last turn's ``####`` answer.
"""

import ast
import operator

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
             ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT = 100
INSTRUCTION = ("Let's think step by step. You can call the calculator tool for arithmetic. Output the final answer "
               "after \"####\".")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: The expression, for example "(48 / 2) * 3 + 7".
    """
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponents above {MAX_EXPONENT} are not computed")
            return OPERATORS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"only numbers and + - * / // % ** are allowed, not {ast.unparse(node)!r}")

    result = value(ast.parse(expression.replace(",", ""), mode="eval").body)
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(result)


def convert(row: dict, i: int, split: str) -> dict:
    """examples/gsm8k_to_parquet.py's row, with the calculator offered and named in the instruction."""
    from gsm8k_to_parquet import convert as plain

    out = plain(row, i, split)
    out["prompt"][0]["content"] = f"{row['question']} {INSTRUCTION}"
    out["extra_info"]["tools_kwargs"] = {"calculator": {"create_kwargs": {}}}
    return out


if __name__ == "__main__":
    from convert import run

    run(convert, __doc__)
