"""The browser tests' Chromium page and artifacts folder, for the JupyterLab of the wheel's fresh environment."""

from tests.browser.conftest import artifacts, page  # noqa: F401 (fixtures)
