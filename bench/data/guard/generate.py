#!/usr/bin/env python3
"""Writes bench/data/guard/texts.jsonl: the labelled data set of the PII and secret guard,
deterministically (fixed seed, no inputs).

Each line is one text: {"id", "lang", "text", "entities": [{"type", "start", "end"}], "cuts"}.
`start`/`end` are character offsets (Python string indices) of each planted value; `type` is a
guard entity name (email, phone, card, iban, ssn, ip, url_credentials, secret). `cuts` are
character offsets where a streamed answer would be split into chunks, some of them inside a
value. Texts are prompts in English, German, French and Spanish; values sit at random places
among prose and code; one text in five carries only hard negatives (version strings, order
numbers failing Luhn, IBANs failing mod 97, SSNs in areas never issued, hex digests, UUIDs,
dates, amounts, code), and others carry some beside their values.

Run: python3 bench/data/guard/generate.py
"""
import json
import os
import random
import string

rng = random.Random(20261204)
N_TEXTS = 2400

# ---- values -------------------------------------------------------------------------------

FIRST = ["anna", "jonas", "marie", "lucas", "sofia", "mateo", "emma", "noah", "lea", "pablo",
         "chloe", "liam", "ines", "felix", "clara", "hugo", "julia", "diego", "nora", "oscar"]
LAST = ["mueller", "schmidt", "dubois", "martin", "garcia", "lopez", "smith", "jones", "weber",
        "moreau", "fernandez", "brown", "fischer", "bernard", "ruiz", "taylor"]
DOMAINS = ["example.com", "corp.example.org", "mail.example.de", "firma-beispiel.de",
           "exemple.fr", "ejemplo.es", "uni-example.ac.uk", "startup.io", "example.co.uk"]


def email():
    f, l = rng.choice(FIRST), rng.choice(LAST)
    local = rng.choice([f"{f}.{l}", f"{f[0]}{l}", f"{f}_{l}{rng.randint(1, 99)}", f"{f}+{rng.choice(['work', 'news', 'x'])}", f"{l}.{f}"])
    if rng.random() < 0.1:
        local = local.capitalize()
    return f"{local}@{rng.choice(DOMAINS)}"


def digits(n):
    return "".join(rng.choice(string.digits) for _ in range(n))


def phone():
    sub = f"{rng.randint(200, 989)}"
    line = f"{rng.randint(0, 9999):04d}"
    return rng.choice([
        lambda: f"({sub}) 555-{line}",
        lambda: f"{sub}-555-{line}",
        lambda: f"{sub}.555.{line}",
        lambda: f"+1 {sub} 555 {line}",
        lambda: f"+1-{sub}-555-{line}",
        lambda: f"+44 20 7946 {digits(4)}",
        lambda: f"020 7946 {digits(4)}",
        lambda: f"07700 900{digits(3)}",
        lambda: f"+49 30 {digits(8)}",
        lambda: f"030 {digits(8)}",
        lambda: f"0171 {digits(7)}",
        lambda: f"+33 6 {digits(2)} {digits(2)} {digits(2)} {digits(2)}",
        lambda: f"06 {digits(2)} {digits(2)} {digits(2)} {digits(2)}",
        lambda: f"01.{digits(2)}.{digits(2)}.{digits(2)}.{digits(2)}",
        lambda: f"+34 6{digits(2)} {digits(3)} {digits(3)}",
        lambda: f"6{digits(2)} {digits(3)} {digits(3)}",
        lambda: f"91 {digits(3)} {digits(2)} {digits(2)}",
    ])()


def luhn_digit(body):
    total = 0
    for i, ch in enumerate(reversed(body)):
        d = int(ch)
        if i % 2 == 0:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return str((10 - total % 10) % 10)


def card_number(valid=True):
    prefix, length = rng.choice([("4", 16), ("4", 16), ("51", 16), ("55", 16), ("2221", 16),
                                 ("34", 15), ("37", 15), ("6011", 16), ("65", 16), ("3530", 16),
                                 ("36", 14), ("62", 16)])
    body = prefix + digits(length - len(prefix) - 1)
    check = luhn_digit(body)
    if not valid:
        check = str((int(check) + rng.randint(1, 9)) % 10)
    return body + check


def group(num, sizes, sep):
    out, i = [], 0
    for s in sizes:
        out.append(num[i:i + s])
        i += s
    if i < len(num):
        out.append(num[i:])
    return sep.join(out)


def card():
    n = card_number()
    style = rng.random()
    if style < 0.4:
        return n
    sep = rng.choice([" ", "-"])
    if len(n) == 15:
        return group(n, [4, 6, 5], sep)
    if len(n) == 14:
        return group(n, [4, 6, 4], sep)
    return group(n, [4, 4, 4, 4], sep)


IBAN_BBAN = {"DE": lambda: digits(18), "GB": lambda: "".join(rng.choice(string.ascii_uppercase) for _ in range(4)) + digits(14),
             "FR": lambda: digits(23), "ES": lambda: digits(20), "NL": lambda: "".join(rng.choice(string.ascii_uppercase) for _ in range(4)) + digits(10),
             "IT": lambda: rng.choice(string.ascii_uppercase) + digits(22), "AT": lambda: digits(16), "BE": lambda: digits(12)}


def iban_check(cc, bban):
    s = bban + cc + "00"
    n = int("".join(str(int(c, 36)) for c in s))
    return f"{98 - n % 97:02d}"


def iban(valid=True):
    cc = rng.choice(list(IBAN_BBAN))
    bban = IBAN_BBAN[cc]()
    check = iban_check(cc, bban)
    if not valid:
        check = f"{(int(check) + rng.randint(1, 50)) % 97 + 2:02d}"
        if check == iban_check(cc, bban):
            check = f"{(int(check) + 1) % 97 + 2:02d}"
    compact = cc + check + bban
    if rng.random() < 0.5:
        return compact
    return " ".join(compact[i:i + 4] for i in range(0, len(compact), 4))


def ssn(valid=True):
    if valid:
        area = rng.choice([a for a in range(1, 900) if a != 666])
        return f"{area:03d}-{rng.randint(1, 99):02d}-{rng.randint(1, 9999):04d}"
    area = rng.choice([0, 666, rng.randint(900, 999)])
    return f"{area:03d}-{rng.randint(1, 99):02d}-{rng.randint(1, 9999):04d}"


def ip():
    if rng.random() < 0.7:
        return ".".join(str(x) for x in [rng.choice([10, 172, 192, 84, 203, 198]), rng.randint(0, 255), rng.randint(0, 255), rng.randint(1, 254)])
    groups = [f"{rng.randint(0, 0xffff):x}" for _ in range(8)]
    if rng.random() < 0.5:
        return "2001:db8::" + ":".join(groups[:3])
    return ":".join(groups)


def url_credentials():
    scheme = rng.choice(["postgres", "mysql", "https", "redis", "amqp", "mongodb"])
    user = rng.choice(["admin", "app", "svc_" + rng.choice(LAST), "root", rng.choice(FIRST)])
    pw = "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(rng.randint(8, 20)))
    host = rng.choice(["db.internal", "10.0.3.7", "cache.prod.example.com", "mq.example.net", "localhost.example"])
    return f"{scheme}://{user}:{pw}@{host}"


B64U = string.ascii_letters + string.digits + "-_"
ALNUM = string.ascii_letters + string.digits


def rand(alphabet, n):
    return "".join(rng.choice(alphabet) for _ in range(n))


def secret():
    kind = rng.choice(["aws", "openai", "anthropic", "google", "github", "slack", "jwt", "pem"])
    if kind == "aws":
        return rng.choice(["AKIA", "ASIA"]) + rand(string.ascii_uppercase + string.digits, 16)
    if kind == "openai":
        return "sk-proj-" + rand(B64U, 48) + rand(string.digits, 2)
    if kind == "anthropic":
        return "sk-ant-api03-" + rand(B64U, 93) + "AA"
    if kind == "google":
        return "AIza" + rand(B64U, 35)
    if kind == "github":
        return rng.choice(["ghp_", "gho_", "ghs_"]) + rand(ALNUM, 36)
    if kind == "slack":
        return f"xoxb-{digits(11)}-{digits(13)}-{rand(ALNUM, 24)}"
    if kind == "jwt":
        import base64
        enc = lambda s: base64.urlsafe_b64encode(s.encode()).decode().rstrip("=")
        return enc('{"alg":"HS256","typ":"JWT"}') + "." + enc(json.dumps({"sub": digits(6), "name": rng.choice(FIRST)})) + "." + rand(B64U, 43)
    body = "\n".join(rand(string.ascii_letters + string.digits + "+/", 64) for _ in range(rng.randint(2, 5)))
    label = rng.choice(["RSA PRIVATE KEY", "PRIVATE KEY", "EC PRIVATE KEY", "OPENSSH PRIVATE KEY"])
    return f"-----BEGIN {label}-----\n{body}\n-----END {label}-----"


MAKERS = {"email": email, "phone": phone, "card": card, "iban": iban, "ssn": ssn, "ip": ip,
          "url_credentials": url_credentials, "secret": secret}

# ---- hard negatives -------------------------------------------------------------------------


def negative():
    return rng.choice([
        lambda: f"v{rng.randint(0, 20)}.{rng.randint(0, 40)}.{rng.randint(0, 99)}",
        lambda: f"{rng.randint(1, 9)}.{rng.randint(0, 30)}.{rng.randint(0, 9)}",
        lambda: f"order #{card_number(valid=False)}",
        lambda: f"Bestellnummer {card_number(valid=False)}",
        lambda: f"ref {digits(12)}",
        lambda: rand("0123456789abcdef", 64),
        lambda: rand("0123456789abcdef", 40),
        lambda: f"{rand('0123456789abcdef', 8)}-{rand('0123456789abcdef', 4)}-4{rand('0123456789abcdef', 3)}-a{rand('0123456789abcdef', 3)}-{rand('0123456789abcdef', 12)}",
        lambda: iban(valid=False),
        lambda: ssn(valid=False),
        lambda: f"{rng.randint(2019, 2026)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
        lambda: f"{rng.randint(1, 28):02d}.{rng.randint(1, 12):02d}.{rng.randint(2019, 2026)}",
        lambda: f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}",
        lambda: f"{rng.randint(1, 9)},{digits(3)}.{digits(2)} USD",
        lambda: f"{rng.randint(1, 9)}.{digits(3)},{digits(2)} €",
        lambda: "`std::io::Result<()>`",
        lambda: "`for i in range(10): print(i * 3)`",
        lambda: f"`let port = {rng.randint(1024, 65535)};`",
        lambda: "`arr[0x1F] = 255; mask = 0xFFFF0000;`",
        lambda: f"localhost:{rng.randint(1024, 65535)}",
        lambda: "pip install scikit-learn==1.4.2",
        lambda: "the task-runner and sk-learn wrappers",
        lambda: f"build {rng.randint(1, 9)}.{rng.randint(0, 9)}.{rng.randint(0, 9)}.{rng.randint(256, 9999)}",
        lambda: f"@{rng.choice(FIRST)} please review",
        lambda: f"ISBN 978-3-{digits(2)}-{digits(6)}-{rng.randint(0, 9)}",
        lambda: f"ticket {rng.choice(['JIRA', 'OPS'])}-{rng.randint(100, 9999)}",
        lambda: f"timestamp {rng.randint(1600000000, 1800000000)}",
        lambda: f"{rng.randint(10, 99)} {rng.randint(100, 999)} {rng.randint(100, 999)} units",
    ])()


# ---- prose ---------------------------------------------------------------------------------

LANG = {
    "en": {
        "intro": ["Please summarize the message below.", "Draft a polite reply to this customer.",
                  "Can you check this config for mistakes?", "Translate the following into French.",
                  "Help me write a follow-up email.", "Review this snippet before I deploy it."],
        "slot": {"email": ["You can reach me at {v}.", "Send the invoice to {v} please.", "cc {v} on the thread"],
                 "phone": ["Call me on {v} after five.", "My number is {v}.", "Phone: {v}"],
                 "card": ["I paid with card {v} but was charged twice.", "Card number: {v}", "charge {v} for the renewal"],
                 "iban": ["Please wire the refund to {v}.", "IBAN {v}", "our account is {v} at the bank"],
                 "ssn": ["My SSN is {v}.", "SSN: {v} for the tax form", "the applicant's social security number {v}"],
                 "ip": ["The server at {v} keeps timing out.", "allowlist {v} in the firewall", "ping {v} fails"],
                 "url_credentials": ["DATABASE_URL={v}/app", "connect with {v}:5432", "the broker is {v}/vhost"],
                 "secret": ["export API_KEY={v}", "here is the token: {v}", "my key {v} stopped working", "key file:\n{v}\n"]},
        "filler": ["The meeting moved to Thursday.", "Thanks in advance!", "It worked last week.",
                   "We need this by Friday.", "See version {n} for details.", "Nothing else changed."],
    },
    "de": {
        "intro": ["Bitte fasse die folgende Nachricht zusammen.", "Schreibe eine höfliche Antwort an den Kunden.",
                  "Kannst du diese Konfiguration prüfen?", "Übersetze den Text ins Englische."],
        "slot": {"email": ["Meine E-Mail-Adresse lautet {v}.", "Schick die Rechnung an {v}, danke.", "Kontakt: {v}"],
                 "phone": ["Ruf mich unter {v} an.", "Telefon: {v}", "erreichbar unter {v} ab 9 Uhr"],
                 "card": ["Ich habe mit der Karte {v} bezahlt.", "Kartennummer {v}", "belaste bitte {v}"],
                 "iban": ["Bitte überweise an {v}.", "IBAN: {v}", "unser Konto {v} bei der Sparkasse"],
                 "ssn": ["Die SSN des Mitarbeiters ist {v}.", "US-Sozialversicherungsnummer {v}"],
                 "ip": ["Der Server {v} antwortet nicht.", "Freigabe für {v} in der Firewall"],
                 "url_credentials": ["Verbindung: {v}/shop", "die Datenbank-URL ist {v}"],
                 "secret": ["Der Schlüssel {v} funktioniert nicht mehr.", "Token: {v}", "export TOKEN={v}"]},
        "filler": ["Das Treffen ist am Donnerstag.", "Vielen Dank im Voraus!", "Letzte Woche ging es noch.",
                   "Siehe Version {n}.", "Sonst hat sich nichts geändert."],
    },
    "fr": {
        "intro": ["Résume le message ci-dessous, s'il te plaît.", "Rédige une réponse polie à ce client.",
                  "Peux-tu vérifier cette configuration ?", "Traduis le texte suivant en anglais."],
        "slot": {"email": ["Vous pouvez m'écrire à {v}.", "Envoyez la facture à {v}.", "contact : {v}"],
                 "phone": ["Appelez-moi au {v}.", "Téléphone : {v}", "mon portable est le {v}"],
                 "card": ["J'ai payé avec la carte {v}.", "numéro de carte {v}", "débitez {v} s'il vous plaît"],
                 "iban": ["Merci de virer le remboursement sur {v}.", "IBAN : {v}", "notre compte {v}"],
                 "ssn": ["Le SSN américain du salarié est {v}.", "SSN : {v}"],
                 "ip": ["Le serveur {v} ne répond plus.", "autoriser {v} dans le pare-feu"],
                 "url_credentials": ["chaîne de connexion : {v}/base", "l'URL est {v}"],
                 "secret": ["Ma clé {v} ne marche plus.", "jeton : {v}", "export CLE={v}"]},
        "filler": ["La réunion est jeudi.", "Merci d'avance !", "Ça marchait la semaine dernière.",
                   "Voir la version {n}.", "Rien d'autre n'a changé."],
    },
    "es": {
        "intro": ["Resume el siguiente mensaje, por favor.", "Escribe una respuesta amable a este cliente.",
                  "¿Puedes revisar esta configuración?", "Traduce el texto al inglés."],
        "slot": {"email": ["Mi correo es {v}.", "Envía la factura a {v}, gracias.", "contacto: {v}"],
                 "phone": ["Llámame al {v}.", "Teléfono: {v}", "mi móvil es el {v}"],
                 "card": ["Pagué con la tarjeta {v}.", "número de tarjeta {v}", "cobra a {v} la renovación"],
                 "iban": ["Haz la transferencia a {v}.", "IBAN: {v}", "nuestra cuenta {v}"],
                 "ssn": ["El SSN del empleado es {v}.", "SSN: {v}"],
                 "ip": ["El servidor {v} no responde.", "permite {v} en el cortafuegos"],
                 "url_credentials": ["cadena de conexión: {v}/tienda", "la URL es {v}"],
                 "secret": ["Mi clave {v} dejó de funcionar.", "token: {v}", "export CLAVE={v}"]},
        "filler": ["La reunión es el jueves.", "¡Gracias de antemano!", "Funcionaba la semana pasada.",
                   "Ver la versión {n}.", "No cambió nada más."],
    },
}
TYPES = list(MAKERS)


def sentence(parts, entities, text_so_far):
    """Appends `parts` (strings, or (type, template, value) triples) and records value offsets."""
    out = text_so_far
    for p in parts:
        if isinstance(p, str):
            out += p
            continue
        typ, template, value = p
        pre, post = template.split("{v}")
        out += pre
        entities.append({"type": typ, "start": len(out), "end": len(out) + len(value)})
        out += value + post
    return out


def text_item(i):
    lang = rng.choices(list(LANG), weights=[4, 2, 2, 2])[0]
    L = LANG[lang]
    negatives_only = rng.random() < 0.2
    n_values = 0 if negatives_only else rng.choice([1, 1, 2, 2, 3])
    n_neg = rng.choice([1, 2, 3]) if negatives_only else rng.choice([0, 0, 1, 2])
    pieces = [rng.choice(L["intro"])]
    for _ in range(n_values):
        typ = rng.choice(TYPES)
        pieces.append((typ, rng.choice(L["slot"][typ]), MAKERS[typ]()))
    for _ in range(n_neg):
        pieces.append(f"({negative()})")
    for _ in range(rng.randint(0, 3)):
        pieces.append(rng.choice(L["filler"]).replace("{n}", f"{rng.randint(1, 9)}.{rng.randint(0, 9)}.{rng.randint(0, 20)}"))
    head, rest = pieces[0], pieces[1:]
    rng.shuffle(rest)
    entities = []
    text = head
    for p in rest:
        text = sentence([rng.choice([" ", "\n", " "]), p], entities, text)
    cuts = sorted(set(rng.randint(1, len(text) - 1) for _ in range(rng.randint(2, 8)) if len(text) > 2))
    for e in entities:  # make sure some cuts fall inside values
        if rng.random() < 0.5 and e["end"] - e["start"] > 2:
            cuts.append(rng.randint(e["start"] + 1, e["end"] - 1))
    return {"id": i, "lang": lang, "text": text, "entities": entities, "cuts": sorted(set(cuts))}


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "texts.jsonl")
    counts = {}
    with open(path, "w", encoding="utf-8") as f:
        for i in range(N_TEXTS):
            item = text_item(i)
            for e in item["entities"]:
                counts[e["type"]] = counts.get(e["type"], 0) + 1
            f.write(json.dumps(item, ensure_ascii=False) + "\n")
    print(f"wrote {N_TEXTS} texts to {path}; values per type: {json.dumps(counts, sort_keys=True)}")


if __name__ == "__main__":
    main()
