"""The page at `/` of `vl serve` in headless Chromium (Debian's `chromium`
and `chromium-driver`, driven over WebDriver by selenium with that driver:
nothing downloads a browser): upload a shipped sample, wait for the
streamed caption and check it against `vl caption`, hover two words and
check the heatmap follows, keep a screenshot under target/page-test/.

    apt-get install chromium chromium-driver
    .venv/bin/pip install selenium pytest
    VL_BIN=target/debug/vl .venv/bin/pytest -q tests/python/test_page_chromium.py
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
VL = os.environ.get("VL_BIN", str(ROOT / "target" / "debug" / "vl"))
SAMPLE = ROOT / "models" / "shapes-captioner" / "samples" / "scene_0001.png"
OUT = ROOT / "target" / "page-test"
CHROMIUM = shutil.which("chromium")
DRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def base():
    proc = subprocess.Popen([VL, "serve", "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("listening on "), line
        yield line.removeprefix("listening on ")
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


@pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="chromium and chromium-driver are not installed")
def test_page_captions_and_shows_heatmaps(base):
    want = subprocess.run([VL, "caption", str(SAMPLE)], capture_output=True, text=True,
                          check=True).stdout.strip()
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1000,1000"):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(DRIVER), options=options)
    OUT.mkdir(parents=True, exist_ok=True)
    try:
        browser.set_page_load_timeout(30)
        browser.get(base + "/")
        wait = WebDriverWait(browser, 60)
        wait.until(lambda b: b.find_element(By.ID, "model").text.startswith("model: "))
        browser.find_element(By.ID, "file").send_keys(str(SAMPLE))
        wait.until(lambda b: b.find_element(By.ID, "caption").get_attribute("data-done") != "0")
        caption = browser.find_element(By.ID, "caption")
        assert caption.get_attribute("data-done") == "1", browser.find_element(By.ID, "error").text
        assert caption.text.strip() == want
        words = caption.find_elements(By.CSS_SELECTOR, "span.tok")
        assert len(words) >= 2
        heat = browser.find_element(By.ID, "heat")

        def painted():
            return browser.execute_script(
                "const c = document.getElementById('heat');"
                "const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
                "let s = 0; for (let i = 3; i < d.length; i += 4) s += d[i]; return s;")

        ActionChains(browser).move_to_element(words[0]).perform()
        wait.until(lambda b: heat.get_attribute("data-token") == "0")
        first = painted()
        ActionChains(browser).move_to_element(words[-1]).perform()
        last = words[-1].get_attribute("data-index")
        wait.until(lambda b: heat.get_attribute("data-token") == last)
        second = painted()
        assert first > 0 and second > 0
        assert first != second, "the heatmap did not change between words"
        browser.save_screenshot(str(OUT / "page.png"))
    finally:
        browser.quit()
