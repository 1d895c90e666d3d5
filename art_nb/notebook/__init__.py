"""Notebook views: live dashboard, static plots. Imported only by notebooks (needs the `notebook` extra)."""
