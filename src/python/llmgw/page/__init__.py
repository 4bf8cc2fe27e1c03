"""The cluster page's files: HTML, CSS and JavaScript modules, shipped as package data.

No build step and nothing fetched from elsewhere: the browser loads these as they are, from
the control plane (`llmgw.server.admin.page` serves them at / and /page/NAME). The scripts talk only
to the admin API, with the session cookie the page's login set; they never see the admin
credential and keep nothing in the browser's storage.
"""
