"""Model text made inert: every way Markdown or HTML makes a browser fetch a URL, obfuscated too.

The oracle is a real CommonMark renderer with raw HTML on (markdown-it-py, what a permissive
client would do) and the HTML parser: the rendered page must hold no element or attribute that
loads a URL. The browser test (tests/browser/test_webui_no_remote_fetch.py) renders the same
vectors in Chromium through Gradio's own front end.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest
from markdown_it import MarkdownIt

from llmplatform.webui.components import SafeChatbot, SafeMarkdown
from llmplatform.webui.safe_markdown import ZWSP, neutralize, restore

HOST = "http://203.0.113.7:8080"

FETCHING_TAGS = {"img", "image", "iframe", "frame", "video", "audio", "source", "track",
                 "embed", "object", "link", "script", "style", "svg", "picture", "input",
                 "meta", "base"}
FETCHING_ATTRIBUTES = {"src", "srcset", "poster", "data", "background", "style", "action",
                       "formaction", "xlink:href", "lowsrc", "dynsrc", "ping"}


class _Elements(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))

    handle_startendtag = handle_starttag

    def handle_data(self, data):
        self.text.append(data)


def rendered(markdown: str) -> _Elements:
    html = MarkdownIt("commonmark", {"html": True}).enable("table").render(markdown)
    parser = _Elements()
    parser.feed(html)
    return parser


def assert_fetches_nothing(markdown: str) -> _Elements:
    page = rendered(markdown)
    for tag, attrs in page.elements:
        assert tag not in FETCHING_TAGS, (tag, attrs, markdown)
        assert not FETCHING_ATTRIBUTES & set(attrs), (tag, attrs, markdown)
        if tag == "a":  # a link is fetched on a click only, and never runs script
            assert not (attrs.get("href") or "").lower().startswith("javascript:")
    return page


VECTORS = {
    "markdown image": f"Look: ![a cat]({HOST}/pixel.png)",
    "image with title": f'![a cat]({HOST}/pixel.png "title")',
    "image in angle brackets": f"![x](<{HOST}/pixel.png>)",
    "reference image": f"![a cat][pic]\n\n[pic]: {HOST}/pixel.png",
    "collapsed reference image": f"![pic][]\n\n[pic]: {HOST}/pixel.png",
    "shortcut reference image": f"![pic]\n\n[pic]: {HOST}/pixel.png",
    "image inside a link": f"[![x]({HOST}/pixel.png)]({HOST}/page)",
    "image in a list and a quote": f"- ![x]({HOST}/a.png)\n\n> ![y]({HOST}/b.png)",
    "image in a table": f"| a | b |\n|---|---|\n| ![x]({HOST}/p.png) | <img src={HOST}/q.png> |",
    "raw img": f'<img src="{HOST}/pixel.png">',
    "mixed case img": f"<IMG SRC={HOST}/pixel.png>",
    "img with slash separator": f"<iMg/src={HOST}/pixel.png>",
    "img over two lines": f"<img\nsrc={HOST}/pixel.png>",
    "img in html block": f"<div>\n<img src={HOST}/pixel.png>\n</div>",
    "img with srcset": f'<img srcset="{HOST}/a.png 1x, {HOST}/b.png 2x">',
    "iframe": f"<iframe src={HOST}/frame></iframe>",
    "video with poster": f"<video src={HOST}/v.mp4 poster={HOST}/p.png autoplay></video>",
    "audio with source": f"<audio controls><source src={HOST}/a.mp3></audio>",
    "track": f"<video><track src={HOST}/t.vtt></video>",
    "embed and object": f"<embed src={HOST}/e.swf><object data={HOST}/o.swf></object>",
    "css url in style attribute": f'<div style="background:url({HOST}/bg.png)">x</div>',
    "css url in style element": f"<style>body {{ background: url({HOST}/bg.png) }}</style>",
    "css import": f"<style>@import '{HOST}/s.css';</style>",
    "link stylesheet": f"<link rel=stylesheet href={HOST}/s.css>",
    "link prefetch": f"<link rel=prefetch href={HOST}/next>",
    "svg image": f'<svg><image href="{HOST}/p.png"/></svg>',
    "picture": f"<picture><source srcset={HOST}/p.webp><img src={HOST}/p.png></picture>",
    "input image": f"<input type=image src={HOST}/p.png>",
    "table background": f"<table background={HOST}/bg.png><tr><td>x</td></tr></table>",
    "meta refresh": f'<meta http-equiv="refresh" content="0;url={HOST}/">',
    "base": f"<base href={HOST}/>",
    "script": f"<script src={HOST}/x.js></script>",
    "closing tag and comment": "</div><!-- <img src=x> --><?php ?><![CDATA[ x ]]>",
    "autolink": f"<{HOST}/page>",
    "html entities": f"&lt;img src={HOST}/p.png&gt; &#60;img src={HOST}/q.png&#62;",
    "backslash escaped": f"\\<img src={HOST}/p.png> \\![x]({HOST}/q.png)",
    "javascript link": "[click](javascript:alert(1)) [x](JaVaScRiPt:alert(1))",
    "data uri image": "![dot](data:image/png;base64,iVBORw0KGgo=)",
    "mermaid": f"```mermaid\ngraph TD\nA@{{ img: \"{HOST}/p.png\" }}\n```",
    "indented fence escaping its list item": f"1. a\n\n   ```\n<img src={HOST}/p.png>\n   ```",
    "fence in a definition title": f'[a]: /u "t\n```\n"\n<img src={HOST}/p.png>\n```',
    "fence hidden by latex": f"$$\n```\n$$<img src={HOST}/p.png>\n```",
    "ambiguous closing fence": f"````\n```\n````\n<img src={HOST}/p.png>\n````",
    "closer with a tab": f"```\nx\n```\t\n<img src={HOST}/p.png>\n```",
}


@pytest.mark.parametrize("markdown", VECTORS.values(), ids=VECTORS.keys())
def test_no_vector_fetches_after_neutralising(markdown):
    assert_fetches_nothing(neutralize(markdown))


def test_the_oracle_sees_the_vectors_unneutralised():
    # Without neutralising, the renderer does produce fetching elements: the test above can fail.
    missed = [name for name, markdown in VECTORS.items()
              if not _fetches(rendered(markdown))]
    harmless_anyway = {"closing tag and comment", "autolink", "html entities",
                       "img with slash separator",  # HTML to a browser, not to CommonMark
                       "backslash escaped", "javascript link", "mermaid", "data uri image",
                       "fence in a definition title", "fence hidden by latex",
                       "ambiguous closing fence", "closer with a tab"}
    assert set(missed) <= harmless_anyway


def _fetches(page: _Elements) -> bool:
    return any(tag in FETCHING_TAGS or FETCHING_ATTRIBUTES & set(attrs)
               for tag, attrs in page.elements)


def test_images_show_their_alt_text_and_url_as_text():
    page = assert_fetches_nothing(neutralize(f"![a cat]({HOST}/pixel.png)"))
    shown = "".join(page.text)
    assert "a cat" in shown and f"{HOST}/pixel.png" in "".join(
        [shown] + [attrs.get("href") or "" for _, attrs in page.elements])
    page = assert_fetches_nothing(neutralize(f'<img src="{HOST}/pixel.png">'))
    assert f'<{ZWSP}img src="{HOST}/pixel.png">' in "".join(page.text)


def test_neither_raw_html_nor_image_syntax_survives_outside_code():
    for markdown in VECTORS.values():
        text = neutralize(markdown)
        if "```" in text or "~~~" in text:
            continue  # fenced code is checked by the oracle
        assert not re.search(r"<[A-Za-z/!?]", text), text
        assert "![" not in text and "```mermaid" not in text


def test_fenced_code_is_left_exactly_as_written():
    code = "```html\n<img src=\"a.png\"> ![x](y) <!-- c -->\nif a<b: pass\n```"
    text = f"Here:\n\n{code}\n\nand <b>bold</b>."
    neutral = neutralize(text)
    assert code in neutral
    assert neutral.endswith(f"and <{ZWSP}b>bold<{ZWSP}/b>.")
    tildes = "~~~\n#include <stdio.h>\n~~~"
    assert tildes in neutralize(tildes + "\n<x>")


def test_ordinary_markdown_is_untouched():
    text = ("# Title\n\n**bold**, _it_, `code`, [a link](https://example.com), "
            "a < b, x <3, 2 > 1\n\n- item\n\n| a | b |\n|---|---|\n| 1 | 2 |")
    assert neutralize(text) == text


@pytest.mark.parametrize("markdown", list(VECTORS.values()) + ["", "plain", "a\nb"])
def test_restore_gives_back_the_original(markdown):
    assert restore(neutralize(markdown)) == markdown


def test_newlines_are_normalised_before_looking_at_lines():
    text = neutralize(f"```\r\nx\r\n```\r\n<img src={HOST}/p.png>")
    assert "\r" not in text and f"<{ZWSP}img" in text


def test_chatbot_neutralises_what_it_sends_and_restores_what_it_gets():
    chatbot = SafeChatbot()
    answer = f"![x]({HOST}/p.png) <img src={HOST}/q.png>"
    data = chatbot.postprocess([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": answer,
         "metadata": {"title": f"<img src={HOST}/t.png>", "log": f"![l]({HOST}/l.png)"}},
    ])
    sent = data.root[1]
    assert sent.content[0].text == neutralize(answer)
    assert sent.metadata["title"] == neutralize(f"<img src={HOST}/t.png>")
    assert sent.metadata["log"] == neutralize(f"![l]({HOST}/l.png)")
    back = chatbot.preprocess(data)
    assert back[1]["content"][0]["text"] == answer


def test_chatbot_keeps_only_text_parts():
    from gradio.components.chatbot import ChatbotDataMessages

    data = ChatbotDataMessages.model_validate([{
        "role": "assistant", "metadata": None, "options": None,
        "content": [{"type": "text", "text": "ok"},
                    {"type": "component", "component": "html", "value": f"<img src={HOST}/p>",
                     "constructor_args": {}, "props": {}}]}])
    out = SafeChatbot().postprocess(SafeChatbot().preprocess(data))
    assert [part.text for part in out.root[0].content] == ["ok"]


def test_markdown_component_neutralises_its_value():
    assert SafeMarkdown().postprocess(f"models: ![m]({HOST}/p.png)") == neutralize(
        f"models: ![m]({HOST}/p.png)")
    assert SafeMarkdown().postprocess(None) is None
