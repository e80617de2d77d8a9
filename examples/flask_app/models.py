"""The Flask-SQLAlchemy extension and the app's tables: products, orders, sent receipts."""

from __future__ import annotations

from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import CheckConstraint, ForeignKey
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)


class Product(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "products"
    __table_args__ = (CheckConstraint("stock >= 0", name="stock_not_negative"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str]
    stock: Mapped[int]


class Order(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    product_id: Mapped[int] = mapped_column(ForeignKey("products.id"))
    quantity: Mapped[int]
    email: Mapped[str]


class Receipt(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "receipts"
    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[int] = mapped_column(ForeignKey("orders.id"), unique=True)
    message_id: Mapped[str]
