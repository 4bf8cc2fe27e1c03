"""The admin API and the cluster page: the routes (`api`; the certificate
serials', `certificates`), the private socket the gateway
workers relay them to, the page's logins and live feed, and what an operator's call does
(operations).
"""
