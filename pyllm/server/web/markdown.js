// A small markdown renderer for model replies: fenced code, headings, lists, quotes, tables, rules, bold, italic,
// strikethrough, inline code and http(s) links. Safety comes from the order of work: every piece of model text is
// HTML-escaped before any tag is added, and tags come only from the fixed strings below; attribute values are
// escaped text that a pattern has already limited (a link's URL must start with http:// or https://). The page's
// Content-Security-Policy allows HTML into the DOM only through the Trusted Types policy made here.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const MAX_DEPTH = 8; // block quotes and list items render their insides recursively

// Inline markup of one line (or paragraph) of raw text: code spans first (their insides are shown as written),
// then emphasis and links on the escaped rest.
function inline(raw) {
  const parts = raw.split(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/);
  let out = "";
  for (let i = 0; i < parts.length; i += 3) {
    out += spans(escapeHtml(parts[i]));
    if (i + 2 < parts.length) out += "<code>" + escapeHtml(parts[i + 2]) + "</code>";
  }
  return out;
}

// ``text`` is already escaped: the patterns add tags around runs of it and never look inside tags they added.
function spans(text) {
  return text
    // the URL is escaped text too: &amp; is a query's "&", any other entity (a quote, "<") ends the match
    .replace(/\[([^\]\n]{1,500})\]\((https?:\/\/(?:[^\s()&]|&amp;){1,2000})\)/g,
      (_, label, url) => `<a href="${url}" target="_blank" rel="noopener noreferrer nofollow">${label}</a>`)
    .replace(/\*\*([^*\n]+?)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^\w])__([^_\n]+?)__(?!\w)/g, "$1<strong>$2</strong>")
    .replace(/(^|[^*\w])\*([^*\s](?:[^*\n]*?[^*\s])?)\*(?!\*)/g, "$1<em>$2</em>")
    .replace(/(^|[^\w])_([^_\s](?:[^_\n]*?[^_\s])?)_(?!\w)/g, "$1<em>$2</em>")
    .replace(/~~([^~\n]+?)~~/g, "<del>$1</del>");
}

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_SEP = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

function cells(line) {
  return line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => c.trim());
}

function startsBlock(lines, i) {
  const line = lines[i];
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line) ||
    (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1]) && lines[i + 1].includes("-"));
}

function blocks(lines, depth) {
  let out = "";
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) {
      i++;
    } else if ((m = FENCE.exec(line))) {
      // An open fence runs to the end: while a reply streams its code block is shown as code at once.
      const fence = m[1];
      const body = [];
      for (i++; i < lines.length && !(lines[i].trim().startsWith(fence[0].repeat(fence.length)) &&
        /^\s*[`~]+\s*$/.test(lines[i])); i++) body.push(lines[i]);
      i++;
      const lang = m[2] ? `<span class="lang">${escapeHtml(m[2])}</span>` : "<span></span>";
      out += `<div class="code"><div class="code-head">${lang}<button type="button" class="copy">Copy</button></div>` +
        `<pre><code>${escapeHtml(body.join("\n"))}</code></pre></div>`;
    } else if ((m = HEADING.exec(line))) {
      const n = m[1].length;
      out += `<h${n}>${inline(m[2])}</h${n}>`;
      i++;
    } else if (RULE.test(line)) {
      out += "<hr>";
      i++;
    } else if (QUOTE.test(line)) {
      const inner = [];
      for (; i < lines.length && (m = QUOTE.exec(lines[i])); i++) inner.push(m[1]);
      out += "<blockquote>" + (depth < MAX_DEPTH ? blocks(inner, depth + 1) : escapeHtml(inner.join("\n"))) +
        "</blockquote>";
    } else if ((m = ITEM.exec(line))) {
      const indent = m[1].length;
      const ordered = /\d/.test(m[2]);
      const start = ordered ? parseInt(m[2], 10) : 1;
      const items = [];
      while (i < lines.length) {
        const it = ITEM.exec(lines[i]);
        if (!it || it[1].length !== indent || /\d/.test(it[2]) !== ordered) break;
        const body = [it[3]];
        // the item's continuation: indented lines (a nested list among them), blank lines inside it
        for (i++; i < lines.length; i++) {
          const next = lines[i];
          const lead = next.match(/^\s*/)[0].length;
          if (next.trim() && lead > indent) body.push(next.slice(Math.min(lead, indent + 4)));
          else if (!next.trim() && i + 1 < lines.length && lines[i + 1].match(/^\s*/)[0].length > indent &&
            lines[i + 1].trim()) body.push("");
          else break;
        }
        items.push(body);
      }
      const tag = ordered ? "ol" : "ul";
      const attr = ordered && start !== 1 ? ` start="${start}"` : "";
      out += `<${tag}${attr}>` + items.map((body) => "<li>" + (body.length === 1 || depth >= MAX_DEPTH
        ? inline(body.join("\n")).replace(/\n/g, "<br>")
        : inline(body[0]) + blocks(body.slice(1), depth + 1)) + "</li>").join("") + `</${tag}>`;
    } else if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1]) &&
      lines[i + 1].includes("-")) {
      const head = cells(line);
      const align = cells(lines[i + 1]).map((c) =>
        c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : c.startsWith(":") ? "left" : "");
      const cls = (k) => (align[k] ? ` class="${align[k]}"` : "");
      let table = "<table><thead><tr>" + head.map((c, k) => `<th${cls(k)}>${inline(c)}</th>`).join("") +
        "</tr></thead><tbody>";
      for (i += 2; i < lines.length && lines[i].includes("|") && lines[i].trim(); i++) {
        const row = cells(lines[i]);
        table += "<tr>" + head.map((_, k) => `<td${cls(k)}>${inline(row[k] ?? "")}</td>`).join("") + "</tr>";
      }
      out += `<div class="table">${table}</tbody></table></div>`;
    } else {
      const para = [];
      for (; i < lines.length && lines[i].trim() && (para.length === 0 || !startsBlock(lines, i)); i++) {
        para.push(lines[i]);
      }
      out += "<p>" + para.map(inline).join("<br>") + "</p>";
    }
  }
  return out;
}

// The HTML of the markdown ``text``.
export function renderMarkdown(text) {
  return blocks(String(text).replace(/\r\n?/g, "\n").split("\n"), 0);
}

// The page's only way to assign HTML (its CSP requires Trusted Types where the browser has them): a policy whose
// input is raw model text and whose output is the renderer's.
const policy = window.trustedTypes
  ? window.trustedTypes.createPolicy("pyllm-markdown", { createHTML: (text) => renderMarkdown(text) })
  : { createHTML: (text) => renderMarkdown(text) };

// Replaces the contents of ``element`` with the rendering of the markdown ``text``.
export function setMarkdown(element, text) {
  element.innerHTML = policy.createHTML(text);
}
