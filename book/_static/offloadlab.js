/* offloadlab: the sidebar (☰) and page-contents buttons, at every width.
 *
 * The themes bind their handlers to the first .primary-toggle and .secondary-toggle on the page.
 * Those are the header's buttons, which sphinx-book-theme hides; the buttons the reader sees, in
 * the article header, did nothing. This binds the visible buttons:
 *
 * - where the theme lays the sidebar or page contents out as a column (from 992 px and 1200 px),
 *   the button shows and hides that column;
 * - below that, where they are drawers, it opens the drawer by pressing the theme's own (hidden)
 *   button, whose handler moves the contents into the drawer and opens it, or closes an open one.
 *   A tap outside an open drawer, or Escape, closes it too (the theme's handlers).
 *
 * Each button's aria-expanded says whether what it controls is open. Choosing a heading in an
 * open drawer closes it, so the reader sees where the link went.
 *
 * Also: a figure's lettering is small on a phone, so each figure opens on its own when tapped,
 * where the reader can zoom it.
 */
(() => {
  const PANELS = [
    // kind, the width from which the panel is a column, the class that hides the column
    { kind: "primary", column: "(min-width: 992px)", hidden: "pst-sidebar-hidden" },
    { kind: "secondary", column: "(min-width: 1200px)", hidden: "offloadlab-collapsed" },
  ];

  function setUp({ kind, column, hidden }) {
    const sidebar = document.getElementById(`pst-${kind}-sidebar`);
    const drawer = document.getElementById(`pst-${kind}-sidebar-modal`);
    const themeButton = document.querySelector(`.${kind}-toggle`);
    const buttons = [...document.querySelectorAll(`.bd-header-article .${kind}-toggle`)];
    if (!sidebar || !drawer || !themeButton || buttons.includes(themeButton)) {
      return; // nothing to bind, or the theme's handler is already on the visible button
    }
    const asColumn = window.matchMedia(column);
    const isOpen = () => (asColumn.matches ? !sidebar.classList.contains(hidden) : drawer.open);
    const announce = () => buttons.forEach((b) => b.setAttribute("aria-expanded", String(isOpen())));

    buttons.forEach((button) => {
      button.addEventListener("click", (event) => {
        event.preventDefault();
        event.stopImmediatePropagation();
        if (asColumn.matches) {
          sidebar.classList.toggle(hidden);
        } else if (drawer.open) {
          drawer.close();
        } else {
          themeButton.click();
        }
        announce();
      });
    });
    drawer.addEventListener("click", (event) => {
      if (drawer.open && event.target.closest("a[href]")) setTimeout(() => drawer.close(), 0);
    });
    drawer.addEventListener("close", announce);
    asColumn.addEventListener("change", announce);
    announce();
  }

  function linkFigures() {
    for (const image of document.querySelectorAll("figure img, div.cell_output img")) {
      if (image.closest("a")) continue;
      const link = document.createElement("a");
      link.href = image.src;
      link.className = "offloadlab-figure-link";
      link.title = "Open the figure on its own, to zoom";
      image.replaceWith(link);
      link.append(image);
    }
  }

  const run = () => {
    PANELS.forEach(setUp);
    linkFigures();
  };
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", run);
  } else {
    run();
  }
})();
