// A small Markdown renderer for the model's answers. Safe by construction: every character of the
// text is HTML-escaped first, and the rules below only wrap escaped text in a fixed set of tags
// (p, br, pre, code, strong, em, ul, ol, li, h3-h6, and a for http(s) links), so nothing the model
// writes becomes markup, a script or an attribute of its own.
"use strict";

const minirunMarkdown = (() => {
  const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const escapeHtml = (s) => s.replace(/[&<>"']/g, (c) => ESCAPES[c]);

  // one line of escaped text -> HTML: inline code and links first (held aside, so that emphasis
  // inside them stays literal), then bold and italics
  function inline(escaped) {
    const held = [];
    const hold = (html) => "\u0000" + (held.push(html) - 1) + "\u0000";
    const restore = (t) => t.replace(/\u0000(\d+)\u0000/g, (_, i) => held[Number(i)]);
    let s = escaped.replace(/`([^`]+)`/g, (_, code) => hold("<code>" + code + "</code>"));
    s = s.replace(/\[([^\]]+)\]\((https?:\/\/[^\s()]+)\)/g, (_, text, href) =>   // (its text may hold code)
      hold('<a href="' + href + '" target="_blank" rel="noopener noreferrer">' + restore(text) + "</a>"));
    s = s.replace(/\*\*(?=\S)(.*?\S)\*\*/g, "<strong>$1</strong>");
    s = s.replace(/(^|[^\w])__(?=\S)(.*?\S)__(?!\w)/g, "$1<strong>$2</strong>");
    s = s.replace(/(^|[^*\w])\*(?=[^\s*])(.*?[^\s*])\*(?![*\w])/g, "$1<em>$2</em>");
    s = s.replace(/(^|[^_\w])_(?=[^\s_])(.*?[^\s_])_(?![_\w])/g, "$1<em>$2</em>");
    return restore(s);
  }

  const line = (text) => inline(escapeHtml(text));

  // text -> HTML; an unclosed code fence (an answer still streaming) runs to the end
  function render(source) {
    const lines = String(source).replace(/\u0000/g, "").replace(/\r\n?/g, "\n").split("\n");
    const out = [];
    let para = [];
    let list = null;            // {tag: "ul" | "ol", start, items: [text]}
    const endPara = () => {
      if (para.length) out.push("<p>" + para.map(line).join("<br>") + "</p>");
      para = [];
    };
    const endList = () => {
      if (!list) return;
      const start = list.tag === "ol" && list.start !== 1 ? ' start="' + list.start + '"' : "";
      out.push("<" + list.tag + start + ">" + list.items.map((t) => "<li>" + line(t) + "</li>").join("") +
               "</" + list.tag + ">");
      list = null;
    };
    for (let i = 0; i < lines.length; i++) {
      const text = lines[i];
      const fence = text.match(/^\s*(`{3,}|~{3,})\s*([\w+#.-]*)/);
      if (fence) {
        endPara(); endList();
        const body = [];
        for (i++; i < lines.length && !lines[i].trim().startsWith(fence[1]); i++) body.push(lines[i]);
        const lang = fence[2] ? ' data-lang="' + escapeHtml(fence[2]) + '"' : "";
        out.push("<pre><code" + lang + ">" + escapeHtml(body.join("\n")) + "</code></pre>");
        continue;
      }
      const item = text.match(/^\s*([-*+]|(\d{1,9})[.)])\s+(.*)$/);
      const heading = text.match(/^(#{1,6})\s+(.*)$/);
      if (item) {
        endPara();
        const tag = item[2] ? "ol" : "ul";
        if (list && list.tag !== tag) endList();
        if (!list) list = { tag, start: item[2] ? Number(item[2]) : 1, items: [] };
        list.items.push(item[3]);
      } else if (!text.trim()) {
        endPara(); endList();
      } else if (heading) {
        endPara(); endList();
        const level = Math.min(heading[1].length + 2, 6);
        out.push("<h" + level + ">" + line(heading[2]) + "</h" + level + ">");
      } else if (list && /^\s+\S/.test(text)) {
        list.items[list.items.length - 1] += " " + text.trim();   // an item's continuation line
      } else {
        endList();
        para.push(text);
      }
    }
    endPara(); endList();
    return out.join("");
  }

  return { render, escapeHtml };
})();
