// The book's live calculators: each form runs `offloadlab <command>` in the reader's browser.
//
// This script only moves text between the page and Python: the answer, the JSON and every error
// message come from the package's own command line (book/_ext/calculator_runtime.py), run by
// Pyodide from the site's own _static. Nothing is fetched until the reader first asks, and then
// only from this site: Pyodide's core once per visit (the service worker pyodide-cache.js, at
// the site's root, keeps it for later pages), and the package's estimates layer.
(() => {
  "use strict";

  const here = new URL(".", document.currentScript.src);  // …/_static/calculators/
  const pyodideFolder = new URL("../pyodide/", here);
  const siteRoot = new URL("../../", here);
  let runtime = null;  // a promise of calculator_runtime, shared by every calculator of the page

  // The worker that keeps Pyodide's files: registered when the page opens (it fetches nothing by
  // itself), so that it controls the page by the time the reader asks. Where a browser offers no
  // service worker, the host's caching decides, as before.
  const keeper = "serviceWorker" in navigator && location.protocol !== "file:"
    ? navigator.serviceWorker.register(new URL("pyodide-cache.js", siteRoot), { scope: siteRoot.href })
      .catch((error) => console.warn("Pyodide will be fetched on every page:", error))
    : Promise.resolve();

  // Before Python loads: wait (a few seconds at most) until the worker controls this page.
  async function underTheKeeper() {
    await keeper;
    if (!("serviceWorker" in navigator) || navigator.serviceWorker.controller) return;
    await new Promise((resolve) => {
      navigator.serviceWorker.addEventListener("controllerchange", resolve, { once: true });
      setTimeout(resolve, 3000);
    });
  }

  const hasWebAssembly = () =>
    typeof WebAssembly === "object" && typeof WebAssembly.instantiate === "function";

  function loadScript(url) {
    return new Promise((resolve, reject) => {
      const script = document.createElement("script");
      script.src = url;
      script.onload = resolve;
      script.onerror = () => reject(new Error(`could not load ${url}`));
      document.head.append(script);
    });
  }

  // Pyodide 0.29 never settles loadPyodide() when pyodide.asm.wasm fails to arrive: it only warns
  // "wasm instantiation failed!" on the console (pyodide/pyodide#6296). Listen for that warning
  // while it loads, so that the reader is told and can try again instead of waiting forever.
  function loadPyodideOrFail() {
    const warn = console.warn;
    return new Promise((resolve, reject) => {
      console.warn = (...args) => {
        warn.apply(console, args);
        if (String(args[0]).includes("wasm instantiation failed")) {
          reject(new Error("Python's WebAssembly interpreter (pyodide.asm.wasm) did not load"));
        }
      };
      globalThis.loadPyodide({ indexURL: pyodideFolder.href }).then(resolve, reject);
    }).finally(() => {
      console.warn = warn;
    });
  }

  // Marks on the page's performance timeline (performance.getEntriesByType("mark")) say how long
  // the start took: Python, then the package.
  async function startPython(archive, progress) {
    performance.mark("calculators:asked");
    progress(1, "Loading Python into your browser (Pyodide, about 12 MB, once a visit)…");
    await underTheKeeper();
    if (!globalThis.loadPyodide) await loadScript(new URL("pyodide.js", pyodideFolder));
    const pyodide = await loadPyodideOrFail();
    performance.mark("calculators:python-ready");
    progress(2, "Loading offloadlab's estimates…");
    const response = await fetch(new URL(archive, here));
    if (!response.ok) throw new Error(`could not load the package (${response.status} ${response.url})`);
    pyodide.unpackArchive(await response.arrayBuffer(), "zip", { extractDir: "/home/pyodide/site" });
    pyodide.runPython("import sys; sys.path.insert(0, '/home/pyodide/site')");
    const runtime = pyodide.pyimport("calculator_runtime");
    performance.mark("calculators:package-ready");
    return runtime;
  }

  function setUp(form) {
    const button = form.querySelector(".calculator-go");
    const status = form.querySelector(".calculator-status");
    const bar = form.querySelector(".calculator-progress");
    const result = form.querySelector(".calculator-result");
    const formError = form.querySelector(".calculator-form-error");
    let ready = false;

    const source = form.querySelector(".calculator-source");
    const chooseSource = () => {
      for (const box of form.querySelectorAll("[data-field]")) {
        const input = box.querySelector("[data-flag]");
        const isSource = [...source.options].some((o) => o.value === box.dataset.field);
        if (!isSource) continue;
        box.hidden = box.dataset.field !== source.value;
        input.disabled = box.hidden;
      }
    };
    if (source) {
      source.addEventListener("change", chooseSource);
      form.addEventListener("reset", () => setTimeout(chooseSource, 0));  // after the form has reset
      chooseSource();
    }

    if (!hasWebAssembly()) {
      button.disabled = true;
      status.textContent =
        "This browser runs no WebAssembly, so the calculator cannot start here; the command above gives the same answer.";
      return;
    }
    if (location.protocol === "file:") {
      // browsers refuse a page opened from disk the modules and files Python needs
      button.disabled = true;
      status.textContent =
        "Opened from disk, this page cannot load Python: serve the site's folder (python -m http.server there) and open http://localhost:8000; the command above gives the same answer.";
      return;
    }

    const progress = (step, text) => {
      bar.hidden = false;
      bar.value = step;
      status.textContent = text;
    };

    function showErrors(answer) {
      for (const message of form.querySelectorAll(".calculator-error")) {
        message.hidden = true;
        message.textContent = "";
      }
      for (const input of form.querySelectorAll("[data-flag]")) input.removeAttribute("aria-invalid");
      if (!answer.error) return;
      const input = answer.field && form.querySelector(`[data-flag="${answer.field}"]`);
      const message = input ? form.querySelector(`#${input.id}-error`) : formError;
      if (input) input.setAttribute("aria-invalid", "true");
      message.textContent = answer.error;
      message.hidden = false;
    }

    async function compute() {
      const fields = [...form.querySelectorAll("[data-flag]")]
        .filter((input) => !input.disabled)
        .map((input) => [input.dataset.flag, input.value, input.dataset.required === "1"]);
      try {
        if (!ready) {
          button.disabled = true;
          runtime = runtime || startPython(form.dataset.archive, progress);
        }
        const calculator = await runtime;
        progress(3, "Computing…");
        const answer = JSON.parse(calculator.calculate(form.dataset.command, JSON.stringify(fields)));
        ready = true;
        button.textContent = "Compute";
        showErrors(answer);
        form.querySelector(".calculator-command").textContent = answer.command;
        form.querySelector(".calculator-answer").textContent = answer.status === 0 ? answer.text : "";
        form.querySelector(".calculator-json").textContent = answer.json || "";
        result.hidden = answer.status !== 0;
        form.dataset.status = answer.status;
        form.dataset.runs = Number(form.dataset.runs || 0) + 1;
        // a field's message sits under the field, above; the form's own below the buttons
        status.textContent = answer.status === 0 ? ""
          : `Not computed: see the message ${answer.field ? "above, under its field" : "below"}.`;
      } catch (error) {
        runtime = ready ? runtime : null;  // a failed start may be retried
        const lines = String(error.message).trim().split("\n");  // a Python traceback ends with its error
        showErrors({ error: `The calculator failed: ${lines[lines.length - 1]}`, field: null });
        status.textContent = "";
        form.dataset.status = "failed";
        form.dataset.runs = Number(form.dataset.runs || 0) + 1;
        console.error(error);
      } finally {
        bar.hidden = true;
        button.disabled = false;
      }
    }

    // Enter in a field both changes it and submits the form: one computation answers both.
    let queued = false;
    const schedule = () => {
      if (queued) return;
      queued = true;
      setTimeout(() => {
        queued = false;
        compute();
      }, 0);
    };
    // Back to the book's example: its messages cleared and, once Python runs, its answer again.
    form.addEventListener("reset", () => setTimeout(() => {
      showErrors({});
      status.textContent = "";
      if (ready) schedule();
    }, 0));
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      schedule();
    });
    form.addEventListener("change", (event) => {
      if (ready && event.target.matches("[data-flag], .calculator-source")) schedule();
    });
  }

  for (const form of document.querySelectorAll("form.calculator-form")) setUp(form);
})();
