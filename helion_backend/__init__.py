"""helion_inductor: a torch.compile backend that fuses GEMM epilogues into Helion kernels.

Use it as ``torch.compile(model, backend="helion_inductor", options={...})``. The name resolves
through the ``torch_dynamo_backends`` entry point once the package is installed; importing the
package also registers it, unless the entry point already did.
"""

__version__ = "0.1.0"

BACKEND_NAME = "helion_inductor"

from helion_backend.backend import helion_inductor, register_backend  # noqa: E402
from helion_backend.report import clear_reports, get_reports  # noqa: E402

register_backend()

__all__ = ["BACKEND_NAME", "helion_inductor", "get_reports", "clear_reports", "__version__"]
