"""Print the API's OpenAPI document: `python -m taskloom.api.openapi > docs/openapi.json`.

The running API serves the same document at `/openapi.json`; the checked-in copy lets a reviewer
see an API change in a diff, and a test fails when it is stale.
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

from .app import ApiConfig, create_app


def document() -> dict[str, Any]:
    app = create_app(contextlib.nullcontext, ApiConfig())  # type: ignore[arg-type]  # no client needed
    return app.openapi()


if __name__ == "__main__":
    sys.stdout.write(json.dumps(document(), indent=2, sort_keys=True) + "\n")
