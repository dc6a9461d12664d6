#!/usr/bin/env python3
"""Load a report.html in headless Chromium with the network off, screenshot it and
check the page: no console errors, every plot (svg.plot) present and non-empty
(a line chart: a series path of >= 2 points with a non-zero box; a bar chart:
a bar of non-zero height), the PNG not blank.

usage: browser_check.py REPORT_HTML SCREENSHOT_PNG [--expect-plots ID,ID...]
       browser_check.py --self-test REPORT_HTML   (a broken copy must fail)
exit 0 pass, 1 fail, 77 no chromium."""
import json, os, re, shutil, struct, subprocess, sys, tempfile, zlib

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Network off twice over: no route (a new network namespace, when we may make
# one) and a proxy / resolver that go nowhere.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
         "--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND",
         "--enable-logging=stderr", "--v=0", "--virtual-time-budget=3000"]

def no_network_prefix():
    if shutil.which("unshare") and subprocess.run(["unshare", "-n", "true"]).returncode == 0:
        return ["unshare", "-n"]
    return []

# Runs first in the checked copy: collects errors and console.error calls.
HEAD = """<script>window.__errors=[];
window.addEventListener('error',function(e){__errors.push('error: '+(e.message||e.type))},true);
(function(){var ce=console.error;console.error=function(){__errors.push('console.error: '+
Array.prototype.join.call(arguments,' '));ce.apply(console,arguments)}})();</script>"""
# Runs last: every plot's content, written into the DOM for --dump-dom.
TAIL = """<script>(function(){var out={plots:[],errors:window.__errors};
document.querySelectorAll('svg.plot').forEach(function(svg){var r={id:svg.id,kind:svg.dataset.kind,ok:false};
var box=svg.getBoundingClientRect();r.visible=box.width>0&&box.height>0;
if(svg.dataset.kind==='line'){var best=0;svg.querySelectorAll('path.series').forEach(function(p){
var n=(p.getAttribute('d')||'').split(/[ML]/).filter(function(s){return s.trim()}).length;var b=p.getBBox();
if(b.width>0&&n>best)best=n;});r.points=best;r.ok=r.visible&&best>=2;}
else{var bars=0;svg.querySelectorAll('rect.bar').forEach(function(b){if(b.getBBox().height>=0.5&&parseFloat(b.dataset.value)>0)bars++});
r.bars=bars;r.ok=r.visible&&bars>=1;}
out.plots.push(r);});
var pre=document.createElement('pre');pre.id='check-result';pre.textContent=JSON.stringify(out);
document.body.appendChild(pre);})();</script>"""

def run_chromium(args):
    return subprocess.run(no_network_prefix() + [CHROMIUM] + FLAGS + args,
                          capture_output=True, text=True, timeout=120)

def console_errors(stderr):
    return [l for l in stderr.splitlines()
            if "CONSOLE" in l and ("Uncaught" in l or "rror" in l) or "Uncaught" in l
            or "net::ERR" in l]

def png_not_blank(path):
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"IHDR":
            width = struct.unpack(">I", data[pos + 8:pos + 12])[0]
        if kind == b"IDAT":
            idat += data[pos + 8:pos + 8 + n]
        pos += 12 + n
    raw = zlib.decompress(idat)
    # Distinct byte values in the filtered scanlines: a blank page has ~2.
    return width > 0 and len(set(raw[::7])) > 16

def check(html, png, expect=()):
    problems = []
    page = "file://" + os.path.abspath(html)
    shot = run_chromium([f"--screenshot={png}", "--window-size=1200,3000", "--hide-scrollbars", page])
    problems += [f"console: {l}" for l in console_errors(shot.stderr)]
    if not os.path.exists(png) or os.path.getsize(png) == 0:
        problems.append("no screenshot")
    elif not png_not_blank(png):
        problems.append("screenshot is blank")
    text = open(html, encoding="utf-8").read()
    if re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text):
        problems.append("the page refers to a network resource")
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, "checked.html")
        checked = text.replace("<head>", "<head>" + HEAD, 1).replace("</body>", TAIL + "</body>", 1)
        open(copy, "w", encoding="utf-8").write(checked)
        dom = run_chromium(["--dump-dom", "file://" + copy])
        problems += [f"console: {l}" for l in console_errors(dom.stderr)]
        m = re.search(r'<pre id="check-result">(.*?)</pre>', dom.stdout, re.S)
        if not m:
            return problems + ["the page check did not run"], None
        result = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&")
                            .replace("&lt;", "<").replace("&gt;", ">"))
    problems += result["errors"]
    if not result["plots"]:
        problems.append("no plots")
    for p in result["plots"]:
        if not p["ok"]:
            problems.append(f"plot {p['id']} is empty: {p}")
    ids = {p["id"] for p in result["plots"]}
    problems += [f"plot plot-{e} missing" for e in expect if f"plot-{e}" not in ids]
    return problems, result

def empty_plot(text, plot_id):
    """The page with every series of one plot emptied (d="")."""
    start = text.index(f'id="{plot_id}"')
    end = text.index("</svg>", start)
    return text[:start] + re.sub(r' d="[^"]*"', ' d=""', text[start:end]) + text[end:]

def main():
    if CHROMIUM is None:
        print("SKIP: no chromium"); sys.exit(77)
    if sys.argv[1] == "--self-test":
        # The check must be able to fail: a script error and an emptied plot.
        text = open(sys.argv[2], encoding="utf-8").read()
        with tempfile.TemporaryDirectory() as tmp:
            for name, broken in (
                    ("script error", text.replace("</body>", "<script>undefinedFunction();</script></body>", 1)),
                    ("empty plot", empty_plot(text, "plot-lr"))):
                assert broken != text, name
                path = os.path.join(tmp, "broken.html")
                open(path, "w", encoding="utf-8").write(broken)
                problems, _ = check(path, os.path.join(tmp, "broken.png"))
                if not problems:
                    print(f"FAIL: a report with a {name} passed the browser check"); sys.exit(1)
                print(f"self-test: a report with a {name} fails: {problems[0][:120]}")
        sys.exit(0)
    html, png = sys.argv[1], sys.argv[2]
    expect = sys.argv[4].split(",") if len(sys.argv) > 4 and sys.argv[3] == "--expect-plots" else []
    problems, result = check(html, png, expect)
    if result:
        print("plots: " + ", ".join(f"{p['id']}({p.get('points', p.get('bars'))})" for p in result["plots"]))
    if problems:
        print("FAIL:\n  " + "\n  ".join(problems)); sys.exit(1)
    print(f"browser check: PASS ({os.path.getsize(png)} byte screenshot)")

main()
