"""Integrations with outside engines, each in its own subpackage behind a small
interface; importing llamarl_core never imports them."""
