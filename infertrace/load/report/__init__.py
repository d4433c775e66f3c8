"""The HTML run report of `infertrace bench --report`: figures over a run's records and series, one page."""

from infertrace.load.report.page import render_html, report_document, write_report

__all__ = ["render_html", "report_document", "write_report"]
