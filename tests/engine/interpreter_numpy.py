# Run ahead of a script under Triton's interpreter (TRITON_INTERPRET=1; the tests read this file as text and put it
# first): Triton 3.6's interpreter takes a scalar as an index by int() of its one-element array, which numpy 2.4
# refuses ("only 0-dimensional arrays ..."); a kernel's loop bound computed from loaded values is such a scalar.
import triton.runtime.interpreter as interpreter

_patch_tensor = interpreter._patch_lang_tensor


def _patch_lang_tensor(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


interpreter._patch_lang_tensor = _patch_lang_tensor
