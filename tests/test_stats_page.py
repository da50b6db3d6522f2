"""The /stats page in a real headless browser (Chromium from Debian's packages), after a
replay of requests in four languages: the page draws its charts from /stats/data.

Marked ``browser``: the default run (``launcher/test``) leaves it out; run it where Chromium
is installed with ``pytest -m browser``. Without Chromium it fails: it is never skipped.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from matplotlib import image

from localspec.server import ServerSettings, create_app
from tests.ops_support import wait_until
from tests.spec_support import follow_drafting
from tests.test_server_http import Live, start, stop

pytestmark = pytest.mark.browser

CODE = {
    "python": "import os\n\ndef main(argv):\n    for a in argv:\n        print(a)\n",
    "c": "#include <stdio.h>\nint main(void) {\n    return 0;\n}\n",
    "javascript": "const fs = require('fs');\nfunction f(a) {\n  return a;\n}\n",
    "shell": '#!/bin/sh\nset -e\nfor f in *.txt; do\n  echo "$f"\ndone\n',
}
SCREENSHOT = os.environ.get("LOCALSPEC_STATS_SCREENSHOT")  # also save it here (docs/)


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("Chromium is not installed (apt-get install -y chromium)")
    return exe


@pytest.fixture(scope="module")
def live(qwen_follow: Path, qwen_follow_draft: Path) -> Iterator[Live]:
    engine = follow_drafting(qwen_follow, qwen_follow_draft, 6)
    server = start(create_app(ServerSettings(port=0), engine))
    yield server
    stop(server)


def _browse(url: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--window-size=1400,1000", "--virtual-time-budget=4000", *flags, url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_stats_page_draws_the_replayed_requests(live: Live, tmp_path: Path) -> None:
    with live.client() as c:
        for i in range(24):
            code = list(CODE.values())[i % 4]
            r = c.post(
                "/infill",
                json={
                    "input_prefix": code,
                    "input_suffix": "\n",
                    "prompt": "",
                    "n_predict": 8 + i % 8,
                    "temperature": 0,
                    "id_slot": i % 2,
                },
            )
            assert r.status_code == 200, r.text
    wait_until(lambda: sum(live.service.spec.requests.values()) == 24)
    assert set(live.service.spec.requests) == set(CODE)  # every language guessed right

    dom = _browse(f"{live.url}/stats", "--dump-dom")
    assert dom.returncode == 0, dom.stderr
    assert re.search(r'data-points="24"', dom.stdout), dom.stdout[:2000]
    assert re.search(r'id="k-p95">\d+ ms<', dom.stdout)

    shot = tmp_path / "stats.png"
    run = _browse(f"{live.url}/stats", f"--screenshot={shot}")
    assert run.returncode == 0 and shot.exists(), run.stderr
    pixels = image.imread(shot)[..., :3]
    # the charts' colours: request dots (blue), acceptance bars by position (orange)
    blue = np.all(np.abs(pixels - np.array([0x5F, 0xB3, 0xF9]) / 255) < 0.06, axis=-1).sum()
    orange = np.all(np.abs(pixels - np.array([0xF9, 0xA6, 0x5F]) / 255) < 0.06, axis=-1).sum()
    assert blue > 500 and orange > 500, (blue, orange)
    if SCREENSHOT:
        shutil.copy(shot, SCREENSHOT)
