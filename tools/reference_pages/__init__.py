"""The generators of the documentation's reference pages, one module per page (cli_page,
configuration_page, http_api_page, metrics_page, checkpoint_page) and the Markdown they share
(markup). tools/docs_reference.py, the mkdocs hook, adds their pages to the site."""
