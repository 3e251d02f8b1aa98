"""Declare the two torchvision operators whose schemas `import torchvision` needs.

sglang imports torchvision while loading its model configs (a dependency of the host
pool module under test). PyPI's torchvision wheels are built against CUDA torch, so on
this CPU torch their C++ library does not load, and torchvision's own import then fails
registering fake kernels for ``nms`` and ``qnms``. Declaring just those schemas lets the
Python package import; nothing here implements them, and nothing in these tests calls a
torchvision operator. Call ``declare_missing_operators()`` before anything imports sglang.
"""

import torch

_libraries: list[torch.library.Library] = []  # the schemas live as long as their library object


def declare_missing_operators() -> None:
    if torch.version.cuda is not None or _libraries:  # a CUDA torch loads torchvision's own library
        return
    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _libraries.append(library)
