"use strict";
// Shades every shown token of report.html by its NLL (or its KLD against the reference), values on hover.
(function () {
  const source = document.getElementById("lit-ppl-data");
  const box = document.getElementById("pages");
  if (!source || !box) return;
  const data = JSON.parse(source.textContent);
  // NLL in nats, linear up to 8; KLD on a log scale from 1e-4 to 1 nat.
  const scales = {
    nll: { strength: (v) => Math.min(Math.max(v / 8, 0), 1), low: "0", high: "≥ 8 nats" },
    kld: { strength: (v) => (v > 0 ? Math.min(Math.max((Math.log10(v) + 4) / 4, 0), 1) : 0), low: "≤ 1e-4", high: "≥ 1 nat" },
  };
  const spans = [];
  for (const page of data.pages) {
    const div = document.createElement("div");
    div.className = "page";
    const head = document.createElement("h3");
    head.textContent = `document ${page.document} · from token ${page.position} · ${page.text.length} tokens`;
    const body = document.createElement("div");
    body.className = "body";
    page.text.forEach((piece, i) => {
      const span = document.createElement("span");
      span.className = "tok";
      span.textContent = piece;
      const p = Math.exp(-page.nll[i]);
      let tip = `${JSON.stringify(piece)}  NLL ${page.nll[i]}  p ${p.toPrecision(3)}`;
      if (data.compare) tip += `  KLD ${page.kld[i]}  reference NLL ${page.nll_base[i]}`;
      span.title = tip;
      span.dataset.nll = page.nll[i];
      if (data.compare) span.dataset.kld = page.kld[i];
      body.appendChild(span);
      spans.push(span);
    });
    div.append(head, body);
    box.appendChild(div);
  }
  function shade(metric) {
    const scale = scales[metric];
    for (const span of spans) {
      const a = scale.strength(Number(span.dataset[metric]));
      span.style.backgroundColor = `rgba(220, 38, 38, ${a.toFixed(3)})`;
    }
    document.getElementById("legend-low").textContent = scale.low;
    document.getElementById("legend-high").textContent = scale.high;
    for (const b of document.querySelectorAll(".controls button")) b.classList.toggle("on", b.dataset.metric === metric);
  }
  for (const b of document.querySelectorAll(".controls button")) b.addEventListener("click", () => shade(b.dataset.metric));
  shade(data.compare ? "kld" : "nll");
})();
