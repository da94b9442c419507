"""Step and kernel-family names are spelled in ``vocabulary.py`` only: every other module of the package reads
them from there, so a rename or a typo cannot leave two spellings of one name behind."""

import ast
from pathlib import Path

from helion_backend import vocabulary as V

PACKAGE = Path(__file__).resolve().parents[1] / "helion_backend"

STEP_NAMES = {*V.EPILOGUE_STEPS, *V.PROLOGUE_STEPS, V.UNPAD, V.RESHAPE}
FAMILY_NAMES = {*V.KERNEL_FAMILIES, *V.MULTI_GEMM_FAMILIES.values()}

# Strings that happen to equal a name but mean something else: (module, string) -> what they are.
OTHER_MEANINGS = {
    ("compile/passes/attention.py", "scale"): "scaled_dot_product_attention's argument",
    ("compile/passes/attention.py", "bias"): "a mask kind of the report",
    ("compile/recognize/quant_patterns.py", "mul"): "a quantization program's instruction",
    ("semantics/quant_program.py", "mul"): "a quantization program's instruction",
    ("layers/quantize.py", "bias"): "the layer's buffer",
    ("compile/passes/normalize.py", "bias"): "aten.addmm's keyword argument",
}


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def literals_in(module: str, source: str, names: set[str]) -> list[str]:
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    return [f"{module}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
            and id(node) not in docstrings and (module, node.value) not in OTHER_MEANINGS]


def literals(names: set[str]) -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if module != "vocabulary.py":
            found += literals_in(module, path.read_text(), names)
    return found


def test_the_vocabulary_constants_are_its_names():
    assert {V.BIAS, V.RESIDUAL, V.SCALE, V.MUL, V.TOKEN_SCALE, V.CHANNEL_SCALE, V.TENSOR_SCALE, V.ACT_SCALE,
            V.UP_MUL, V.CAST, *V.ACTIVATIONS} == set(V.EPILOGUE_STEPS)
    assert {V.QUANT_FP8_PER_TOKEN, V.QUANT_INT8_PER_TOKEN, V.DEQUANT_INT8, V.DEQUANT_INT4, V.DEQUANT_INT4_ZP,
            V.QUANT_FP8_PER_GROUP, V.DEQUANT_FP8_BLOCK, V.RMSNORM} == set(V.PROLOGUE_STEPS)
    assert {V.DEFAULT_KERNEL_FAMILY, V.FP8_FAMILY, V.INT8_FAMILY, V.WEIGHT_ONLY_FAMILY, V.INT4_FAMILY,
            V.FP8_BLOCK_FAMILY, *V.GLU_FAMILIES} == set(V.KERNEL_FAMILIES)
    assert {V.MULTI_GEMM_FAMILY, V.MULTI_GEMM_FP8_FAMILY, V.MULTI_GEMM_INT8_FAMILY} == set(V.MULTI_GEMM_FAMILIES.values())


def test_no_module_spells_a_step_name():
    assert literals(STEP_NAMES) == []


def test_no_module_spells_a_kernel_family_name():
    assert literals(FAMILY_NAMES) == []


def test_the_check_sees_a_literal_and_skips_docstrings():
    source = 'def f(step):\n    """Takes a bias."""\n    return step == "bias" or f"{step}" == "gemm_fp8"\n'
    assert literals_in("x.py", source, STEP_NAMES | FAMILY_NAMES) == ["x.py:3: 'bias'", "x.py:3: 'gemm_fp8'"]
