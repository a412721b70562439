"""The playground page (`/`) in a real headless browser (Debian's chromium and chromedriver,
driven by selenium): streamed turns, what each reused, a fork, and an API key's refusal as the
API words it. The conversations run on an app of the default model (the trained built-in one),
so the screenshot taken mid-conversation, the README's (docs/playground.png), shows the English
replies `serve run config.yaml` gives."""

from __future__ import annotations

import fnmatch
import re
import shutil
import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

from deployments.front import playground_page
from workers.checkpoint.dialogue_corpus import load_conversations, vocabulary, words_of

pytestmark = pytest.mark.timeout(300)
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "playground.png"
WAIT_S = 60


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver, "Debian's chromium and chromium-driver are needed (.ci/run installs them)"
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900",
                     "--force-device-scale-factor=1"):
        options.add_argument(argument)
    browser = webdriver.Chrome(options=options, service=Service(driver))  # no driver download: Debian's
    yield browser
    browser.quit()


def wait(browser: WebDriver, condition, what: str):
    # The page renders a branch anew when a turn starts and ends: an element found just before
    # may be gone by the time it is read, and is looked up again on the next poll.
    return WebDriverWait(browser, WAIT_S, poll_frequency=0.05, ignored_exceptions=(
        StaleElementReferenceException,)).until(lambda b: condition(b), what)


def turns(browser: WebDriver) -> list[WebElement]:
    return browser.find_elements(By.CSS_SELECTOR, "#transcript .turn")


def send(browser: WebDriver, text: str) -> WebElement:
    """Types a message, sends it, and returns its turn once the reply has ended."""
    before = len(turns(browser))
    composer = browser.find_element(By.ID, "composer-input")
    composer.send_keys(text, Keys.ENTER)
    wait(browser, lambda b: len(turns(b)) == before + 1 and turns(b)[-1].get_attribute("data-state") == "done",
         f"the reply to {text!r}")
    return turns(browser)[-1]


def cached(turn: WebElement) -> int:
    return int(turn.find_element(By.CSS_SELECTOR, ".stat-cached").get_attribute("data-value"))


def stat(turn: WebElement, name: str) -> str:
    return turn.find_element(By.CSS_SELECTOR, f".stat-{name} b").text


def open_page(browser: WebDriver, url: str) -> None:
    browser.get(url)
    browser.execute_script("window.sessionStorage.clear()")  # a first visit: no key, a new salt
    browser.get(url)


def set_max_tokens(browser: WebDriver, count: int) -> None:
    field = browser.find_element(By.ID, "max-tokens")
    field.clear()
    field.send_keys(str(count))


def test_a_conversation_shows_its_reuse_and_forks_from_turn_1(builtin, browser):
    open_page(browser, f"{builtin.url}/")
    wait(browser, lambda b: b.find_element(By.ID, "model-name").text == builtin.model, "the model's name")
    set_max_tokens(browser, 32)
    corpus_words = vocabulary(load_conversations())
    messages = ["Hello! Who are you?", "What can you do?", "Tell me more."]
    for number, text in enumerate(messages, start=1):
        turn = send(browser, text)
        reply = turn.find_element(By.CSS_SELECTOR, ".reply")
        assert turn.get_attribute("data-turn") == str(number)
        assert reply.text and int(reply.get_attribute("data-chunks")) > 1  # it arrived in pieces
        assert set(words_of(reply.text)) <= corpus_words, reply.text  # the trained model's English
        assert stat(turn, "ttft").endswith(("ms", " s")) and stat(turn, "replica") != "—"
        if number == 1:
            assert cached(turn) == 0 and stat(turn, "source") == "none"
        else:  # the conversation's own state: only the new message ran
            assert cached(turn) > 0 and stat(turn, "source") == "conversation head"
    assert len(browser.find_elements(By.CSS_SELECTOR, "#chart rect.bar")) == 3
    assert len(browser.find_elements(By.CSS_SELECTOR, "#chart circle.estimate-dot")) == 3
    SCREENSHOT.parent.mkdir(exist_ok=True)
    browser.save_screenshot(str(SCREENSHOT))

    salt = browser.find_element(By.ID, "cache-salt").text
    original = browser.find_element(By.ID, "conversation-id").text
    first_reply = turns(browser)[0].find_element(By.CSS_SELECTOR, ".reply").text
    turns(browser)[0].find_element(By.CSS_SELECTOR, ".fork-btn").click()
    assert [t.find_element(By.CSS_SELECTOR, ".user").text for t in turns(browser)] == messages[:1]
    fork = send(browser, "Something else, then.")
    assert fork.get_attribute("data-turn") == "2" and stat(fork, "replica") != "—"
    shown = [(t.find_element(By.CSS_SELECTOR, ".user").text, t.find_element(By.CSS_SELECTOR, ".reply").text)
             for t in turns(browser)]
    assert shown[0] == (messages[0], first_reply) and shown[1][0] == "Something else, then."
    forked = browser.find_element(By.ID, "conversation-id").text
    assert forked != original
    with httpx.Client(base_url=builtin.url, timeout=30) as http:
        def history(conversation_id: str) -> list[str]:
            response = http.get(f"/v1/conversations/{conversation_id}", params={"cache_salt": salt})
            assert response.status_code == 200, response.text
            return [turn["messages"][-2]["content"] for turn in response.json()["turns"]]

        assert history(forked) == [messages[0], "Something else, then."]  # the fork's own history
        assert history(original) == messages  # the original is untouched
    tabs = browser.find_elements(By.CSS_SELECTOR, ".branch-tab")
    assert [t.text for t in tabs] == ["main · 3", "fork from turn 1 · 2"]
    tabs[0].click()
    assert [t.find_element(By.CSS_SELECTOR, ".user").text for t in turns(browser)] == messages


def test_stateless_mode_reuses_a_prefix_and_regenerating_gives_the_same_greedy_reply(builtin, browser):
    open_page(browser, f"{builtin.url}/")
    wait(browser, lambda b: b.find_element(By.ID, "model-name").text == builtin.model, "the model's name")
    browser.find_element(By.ID, "mode-stateless").click()
    set_max_tokens(browser, 8)
    send(browser, "Hello!")
    second = send(browser, "And then?")  # the whole history again: the first request's end is reused
    assert cached(second) > 0 and stat(second, "source") == "prefix"
    assert browser.find_element(By.ID, "conversation-id").text == "stateless"
    reply = second.find_element(By.CSS_SELECTOR, ".reply").text
    second.find_element(By.CSS_SELECTOR, ".regen-btn").click()
    wait(browser, lambda b: len(turns(b)) == 2 and turns(b)[-1].get_attribute("data-state") == "done",
         "the regenerated turn")
    assert turns(browser)[-1].find_element(By.CSS_SELECTOR, ".reply").text == reply  # temperature 0
    assert [t.text for t in browser.find_elements(By.CSS_SELECTOR, ".branch-tab")] == [
        "main · 2", "regenerate turn 2 · 2"]


def test_with_api_keys_it_asks_for_one_and_shows_the_apis_refusal(stack, notier, browser):
    with httpx.Client(base_url=stack.base_url + notier, timeout=30) as http:
        refusal = http.get("/v1/models", headers={"Authorization": "Bearer wrong"}).json()["error"]["message"]
    open_page(browser, f"{stack.base_url}{notier}/")
    panel = wait(browser, lambda b: b.find_element(By.ID, "key-panel").is_displayed() and b.find_element(
        By.ID, "key-panel"), "the API key prompt")
    panel.find_element(By.ID, "key-input").send_keys("wrong")
    panel.find_element(By.ID, "key-save").click()
    banner = wait(browser, lambda b: b.find_element(By.ID, "error-banner").is_displayed() and b.find_element(
        By.ID, "error-banner"), "the error banner")
    assert banner.text == f"401: {refusal}"
    key = browser.find_element(By.ID, "key-input")
    key.clear()
    key.send_keys("k1")
    browser.find_element(By.ID, "key-save").click()
    wait(browser, lambda b: b.find_element(By.ID, "model-name").text == stack.model, "the model, with a good key")
    set_max_tokens(browser, 4)
    turn = send(browser, "Hello!")
    assert turn.find_element(By.CSS_SELECTOR, ".reply").text and not banner.is_displayed()


def test_the_page_resolves_its_files_under_any_route_prefix():
    """The <base> is the app's root, so the page's relative URLs (its files, the /v1 API) resolve
    under a Serve route prefix whether it is opened as `/prefix` or `/prefix/`; every file it
    names is there, and is package data (pyproject.toml)."""
    assert '<base href="/">' in playground_page.index("")
    assert '<base href="/notier/">' in playground_page.index("/notier")
    named = re.findall(r'(?:src|href)="playground/([^"]+)"', playground_page.index(""))
    assert sorted(named) == ["playground.css", "playground.js"]
    packaged = tomllib.loads((SCREENSHOT.parents[1] / "pyproject.toml").read_text())
    patterns = packaged["tool"]["setuptools"]["package-data"]["deployments"]
    for name in named + ["index.html"]:
        assert (playground_page.FILES / name).is_file()
        assert any(fnmatch.fnmatch(f"front/playground/{name}", p) for p in patterns), name
