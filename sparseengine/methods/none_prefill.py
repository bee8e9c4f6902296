"""Dense prefill: the prefill-side default, combines with every decode method."""

from sparseengine.method_registry import MethodSpec
from sparseengine.methods.base import SparseMethodRuntime


class DensePrefill(SparseMethodRuntime):
    pass


SPEC = MethodSpec(name="none", kind="prefill", family="dense", runtime=DensePrefill, combines_with=("*",))
