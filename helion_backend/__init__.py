"""helion_inductor: a torch.compile backend that fuses GEMM epilogues into Helion kernels.

Use it as ``torch.compile(model, backend="helion_inductor", options={...})``. The name resolves
through the ``torch_dynamo_backends`` entry point once the package is installed; importing the
package also registers it, unless the entry point already did.
"""

from helion_backend.backend import helion_inductor, register_backend
from helion_backend.report import clear_reports, get_reports
from helion_backend.version import __version__
from helion_backend.vocabulary import BACKEND_NAME

register_backend()

__all__ = ["BACKEND_NAME", "helion_inductor", "get_reports", "clear_reports", "__version__"]
