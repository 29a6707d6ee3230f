"""Lowering strategies, one module each, mixed into the lowerer (codegen/lower.py). A schedule
(codegen/schedule.py) names which ones a kernel uses; each module holds both the plan it derives from
the AST and the code it emits."""
