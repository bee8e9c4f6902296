"""Dense attention over the whole cache: the reference every method is measured against."""

from sparseengine.method_registry import MethodSpec
from sparseengine.methods.base import SparseMethodRuntime


class Vanilla(SparseMethodRuntime):
    pass


SPEC = MethodSpec(name="vanilla", kind="decode", family="dense", runtime=Vanilla,
                  prefill_policy="all_chunked")
