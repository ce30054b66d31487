"""`kernels benchmark <repo root>` on a machine that lacks the CLI's signing dependencies.

The kernels CLI imports sigstore (and cryptography) at start-up for `kernels verify-signature` alone; the
lent GPU machine has neither and no network to fetch them. Where they are missing, this stands in empty
modules for them, then runs the real CLI: `python scripts/kernels_benchmark.py . [--output out.json]`.
Run `make variants` (or tools/build_variants.py) first: the CLI loads the kernel from build/.
"""

import importlib.util
import sys
import types


def _stand_in(name: str, **attrs) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module


if importlib.util.find_spec("sigstore") is None or importlib.util.find_spec("cryptography") is None:
    unused = type("Unavailable", (Exception,), {})
    for name in ("sigstore", "sigstore.verify"):
        _stand_in(name, Verifier=unused, policy=None)
    _stand_in("sigstore.errors", VerificationError=unused)
    _stand_in("sigstore.models", Bundle=unused, InvalidBundle=unused)
    _stand_in("sigstore.verify.policy", VerificationPolicy=unused)
    if importlib.util.find_spec("cryptography") is None:
        _stand_in("cryptography")
        _stand_in("cryptography.x509", Certificate=unused)

from kernels.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.argv = ["kernels", "benchmark", *sys.argv[1:]]
    main()
